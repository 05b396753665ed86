"""The HSDP API: shard a module tree into flat units over the (replicate, shard) mesh.

``apply_hsdp_to_model`` is ``prepare_hsdp_shard_context`` (validation, mesh, precision,
ignored and unshardable parameters) followed by ``shard_model`` (each selected module a
unit, children first, then the root). The streaming path calls the same pieces one block at
a time: ``shard_hsdp_module`` per completed child, ``finalize_hsdp_root`` at the end.

Every step validates and builds its units before it touches the model, so an error leaves
the model as it was. Modules and parameters are reached only through the model's tensor
adapter (``hsdp.adapters``), so the same code shards any framework that has one.
"""

from __future__ import annotations

import gc
import logging
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import _C
from ..world import devices, distributed
from .registry import adapter_for
from .built import check_wire_dtype
from .dtypes import DType
from ..world.mesh import DeviceMesh, device_type_of, init_device_mesh
from .policy import MixedPrecisionPolicy, keep_modules, kept, model_param_dtype, storage_dtype, unit_input_dtype
from .schedule import Schedule, _budgeted
from .units import ShardCondition, UnitShardHandle, UnitState

if TYPE_CHECKING:
    from .port import TensorAdapter

log = logging.getLogger("hsdp")

HSDPInferenceConfig = _C.HSDPInferenceConfig


@dataclass(eq=False)
class HSDPShardContext:
    """Everything sharding needs, prepared once and reused block by block."""

    model: Any
    adapter: TensorAdapter
    mesh: DeviceMesh
    mp_policy: MixedPrecisionPolicy
    reshard_after_forward: bool
    hsdp_shard_conditions: list[ShardCondition]
    ignored_params: set[Any]
    target_device: Any = None
    units: list[UnitState] = field(default_factory=list)
    # ids of parameters already placed in a unit (Parameters hash by identity; ids keep the
    # set cheap and never call a user's __eq__).
    owned: set[int] = field(default_factory=set)
    # id -> (unit label, parameter name) of each owned parameter: says who holds a tied one
    owner: dict[int, tuple[str, str]] = field(default_factory=dict)
    whole_bytes: list[Any] = field(default_factory=list)
    # diffusers' _keep_in_fp32_modules: parameters under a module of one of these names keep
    # their own dtype when param_dtype is set (FSDP2 casts them anyway)
    keep_dtype_modules: frozenset[str] = frozenset()
    finalized: bool = False
    prefetch_depth: int = 1
    max_unsharded_bytes: int | None = None
    resident_bytes: int | str | None = None  # the residency budget (hsdp.engine.residency)
    schedule: Schedule | None = None
    # "float8_e4m3fn": shards held and gathered block-scaled (HSDPInferenceConfig.wire_dtype)
    wire_dtype: str | None = None
    # where every unit's buffers live (devices.buffer_device), decided once for the model
    buffer_device: str = devices.HOST

    @property
    def child_units(self) -> list[UnitState]:
        return [u for u in self.units if not u.is_root]


# ---------------------------------------------------------------------------- helpers


def _require_module(model: Any, what: str = "model") -> TensorAdapter:
    return adapter_for(model, what)


def _describe(ad: TensorAdapter, name: str, p: Any) -> str:
    return f"'{name}' ({ad.dtype(p).name}, shape {ad.shape(p)})"


def _resolve_sizes(config: Any, world: Any) -> tuple[int, int]:
    coords = _C.mesh_coords(world.size, world.rank, config.hsdp_replicate_size, config.hsdp_shard_size)
    return coords["replicate"], coords["shard"]


def conditions_list(conditions: Any, what: str) -> list[ShardCondition]:
    """The conditions as a list (None: empty), each one a callable; `what` names where they
    came from (the model attribute, or shard_model's argument) in the errors."""
    if conditions is None:
        return []
    if callable(conditions) or isinstance(conditions, (str, bytes)) or not isinstance(conditions, Iterable):
        # a bare function is the usual slip: list() of it would say only "not iterable"
        shown = getattr(conditions, "__name__", None) or "condition"
        raise TypeError(
            f"{what} must be a list of callables (name, module) -> bool, got a {type(conditions).__name__} "
            f"({conditions!r}); wrap it in a list: [{shown}]"
        )
    conds = list(conditions)
    for c in conds:
        if not callable(c):
            raise TypeError(f"{what} must be callables (name, module) -> bool, got {c!r}")
    return conds


def _check_conditions(conditions: Any, model: Any, what: str) -> list[ShardCondition]:
    conds = conditions_list(conditions, what)
    if not conds:
        raise ValueError(
            f"{type(model).__name__} declares no _hsdp_shard_conditions; HSDP needs at least one "
            "condition (name, module) -> bool selecting the modules to shard (its transformer blocks)"
        )
    return conds


def _attr_conditions(model: Any) -> list[ShardCondition]:
    return _check_conditions(
        getattr(model, "_hsdp_shard_conditions", None), model, f"{type(model).__name__}._hsdp_shard_conditions"
    )


def _refuse_uncalled(name: str, module: Any) -> None:
    children = [c for c, _ in module.named_children()]
    hint = (f"Select its children instead (e.g. '{name}.{children[0]}')" if children
            else "Select the module that uses its parameters instead")
    raise ValueError(
        f"'{name}' ({type(module).__name__}) cannot be an HSDP unit: it is never called (it has no forward of "
        f"its own), and a unit gathers its weights when its module is called, so they would never be gathered. "
        f"{hint}, or change the _hsdp_shard_conditions that select it"
    )


def _select(model: Any, conditions: list[ShardCondition], ad: TensorAdapter) -> list[tuple[str, Any]]:
    """(name, module) of every submodule the conditions make a unit, children first. Refuses,
    before anything changes, a selection that could not run: the root itself, nothing at all,
    or a module that is never called (a ModuleList, say) that would hold parameters, since a
    unit gathers in its module's forward hooks."""
    if any(c("", model) for c in conditions):
        raise ValueError(
            f"an HSDP shard condition selects the root module ({type(model).__name__}) itself; "
            "conditions must select submodules (the root always becomes the last unit)"
        )
    selected = [(n, m) for n, m in post_order(model) if n and any(c(n, m) for c in conditions)]
    if not selected:
        raise ValueError(
            f"no submodule of {type(model).__name__} matched the HSDP shard conditions; nothing "
            "would be sharded"
        )
    claimed: set[int] = set()
    for name, module in selected:  # the claims _build_unit makes, children first
        own = [p for _, p in ad.named_parameters(module) if id(p) not in claimed]
        claimed.update(id(p) for p in own)
        if own and not ad.has_forward(module):
            _refuse_uncalled(name, module)
    return selected


_WIRE_SOURCES = ("float32", "float16", "bfloat16")


def _wire_params(ctx: HSDPShardContext, dtypes: Sequence[DType], names: Sequence[str], shapes: Sequence[Any]) -> Any:
    """Which parameters travel as float8 (None: no wire dtype): floating ones of float32,
    float16 or bfloat16 storage, except those kept in their own dtype (_keep_in_fp32_modules:
    the model asks for their precision) and 0-d ones. Models already in float8 keep theirs."""
    if ctx.wire_dtype is None:
        return None
    keep = ctx.keep_dtype_modules
    return [d.name in _WIRE_SOURCES and not kept(keep, n) and len(tuple(s)) > 0
            for d, n, s in zip(dtypes, names, shapes)]


def _build_unit(ctx: HSDPShardContext, module: Any, fqn: str, is_root: bool, claimed: set[int]) -> UnitState | None:
    """Collects the module's unclaimed parameters into a new C unit filled with this rank's
    shard. Touches nothing on the model; the caller commits. None if there is nothing to hold."""
    ad = ctx.adapter
    names: list[str] = []
    params: list[Any] = []
    for name, p in ad.named_parameters(module):
        full = f"{fqn}.{name}" if fqn else name
        if id(p) in claimed:
            unit_label, first = ctx.owner.get(id(p), ("", ""))
            # an inner unit's parameter is the usual case; another unit's is a tied one
            if first and fqn and not (unit_label == fqn or unit_label.startswith(fqn + ".")):
                raise ValueError(
                    f"parameter '{full}' is the same Parameter as '{first}', which unit '{unit_label or '<root>'}' "
                    f"already holds: hsdp keeps each parameter in one unit, so unit '{fqn}' would run without it. "
                    "Untie them (give each its own copy), or make their common ancestor one unit with "
                    "_hsdp_shard_conditions"
                )
            continue
        if p in ctx.ignored_params:
            continue
        if ad.is_sharded(p):
            raise RuntimeError(f"parameter {_describe(ad, full, p)} is already sharded")
        if not ad.is_shardable(p):
            raise ValueError(
                f"parameter {_describe(ad, full, p)} cannot be sharded: it is 0-dim or not floating "
                "point. Pass it in ignored_params (apply_hsdp_to_model keeps such parameters "
                "whole on every rank for you)"
            )
        names.append(full)
        params.append(p)
    if not params and not is_root:
        return None
    keep = ctx.keep_dtype_modules
    dtypes = tuple(storage_dtype(ad, p, ctx.mp_policy, kept(keep, n)) for p, n in zip(params, names))
    wire_params = _wire_params(ctx, dtypes, names, [ad.shape(p) for p in params])
    unit = _C.Unit(
        ctx.mesh.shard_group,
        [d.name for d in dtypes],
        [ad.shape(p) for p in params],
        params=tuple(params),
        name=fqn or "<root>",
        compute_dtypes=[ad.compute_dtype(d).name for d in dtypes],
        bind_attr=ad.bind_attr,
        device=ctx.buffer_device,
        wire_dtype=ctx.wire_dtype if wire_params else None,
        wire_params=wire_params or None,
    )
    filled = True
    for i, p in enumerate(params):
        src = ad.shard_source(p)
        if src is not None:  # meta parameters are filled later by a loader
            unit.write(i, src[0], src_dtype=src[1])
        else:
            filled = False
    if filled:
        unit.encode()  # the shard is float8 from here (no-op without a wire dtype); else the loader does it
    for p, full in zip(params, names):
        claimed.add(id(p))
        ctx.owner[id(p)] = (fqn, full)
    return UnitState(
        module, fqn, unit, tuple(params), tuple(names), dtypes, ctx.reshard_after_forward, ctx.mp_policy, is_root, ad,
        unit_input_dtype(ctx.mp_policy, dtypes),
    )


def _commit(ctx: HSDPShardContext, states: Iterable[UnitState | None], claimed: set[int]) -> None:
    if ctx.schedule is None:
        ctx.schedule = Schedule(ctx.prefetch_depth, ctx.max_unsharded_bytes, ctx.resident_bytes, ctx.mesh.shard_group)
    done: list[UnitState] = []
    for st in states:
        if st is not None:
            st.schedule = ctx.schedule
            ctx.schedule.units.append(st)
            try:
                st.commit()
            except BaseException as exc:
                # the units already switched would run beside parameters left unsharded:
                # they refuse every use instead, saying why
                for prev in done:
                    prev.mark_broken(f"sharding stopped at unit '{st.label}': {type(exc).__name__}: {exc}")
                raise
            done.append(st)
            ctx.units.append(st)
    ctx.owned = claimed


def post_order(model: Any) -> list[tuple[str, Any]]:
    """(name, module) with every module after its descendants and siblings in order, so inner
    units claim their parameters first and units are numbered as a loader streams them."""
    out: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def walk(prefix: str, module: Any) -> None:
        for name, child in module.named_children():
            if id(child) not in seen:
                seen.add(id(child))
                walk(f"{prefix}.{name}" if prefix else name, child)
        out.append((prefix, module))

    walk("", model)
    return out


def _module_names(model: Any) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules()}


# ---------------------------------------------------------------------------- the API


def _check_config(hsdp_config: Any) -> None:
    """An enabled HSDPInferenceConfig, or a TypeError / ValueError saying what to pass."""
    if not isinstance(hsdp_config, HSDPInferenceConfig):
        from .config import DiffusionParallelConfig

        hint = ""
        if isinstance(hsdp_config, DiffusionParallelConfig):
            hint = "; pass parallel_config.to_hsdp_config() (it takes param_dtype and the other HSDP settings)"
        raise TypeError(f"hsdp_config must be an HSDPInferenceConfig, got {type(hsdp_config).__name__}{hint}")
    if not hsdp_config.enabled:
        raise ValueError("HSDP is not enabled in hsdp_config (enabled=False); set enabled=True")


def prepare_hsdp_shard_context(model: Any, hsdp_config: Any, target_device: Any = None) -> HSDPShardContext:
    """Validate, build the mesh and precision policy, and collect the parameters kept whole.

    The returned context shards completed children (:func:`shard_hsdp_module`) and then the
    root (:func:`finalize_hsdp_root`), so a loader can shard each block as soon as its
    weights are in.
    """
    ad = _require_module(model)
    _check_config(hsdp_config)
    framework = ad.device_type(target_device)  # checks the value
    world = distributed.world_for(framework, f"target_device {target_device!r}")
    ad.check_device(target_device)
    buffers = devices.buffer_device(world, framework, target_device)
    if hsdp_config.wire_dtype is not None:
        check_wire_dtype(hsdp_config.wire_dtype)
        if buffers != devices.HOST:
            devices.prepare_wire(world)  # the device decodes (NCCL: a kernel); what is missing is named
    replicate, shard = _resolve_sizes(hsdp_config, world)

    named = list(ad.named_parameters(model))
    param_dtype = model_param_dtype(ad, model, hsdp_config.param_dtype)
    policy = MixedPrecisionPolicy(
        param_dtype=param_dtype,
        reduce_dtype=hsdp_config.reduce_dtype,
        output_dtype=hsdp_config.output_dtype,
    )

    mesh = init_device_mesh(device_type_of(world), (replicate, shard))
    log.info(
        "HSDP setup: replicate_size=%d shard_size=%d world_size=%d rank=%d",
        replicate, shard, world.size, world.rank,
    )

    conditions = _attr_conditions(model)
    _select(model, conditions, ad)  # refused here, before any module is moved

    ignored: set[Any] = set()
    ignored_modules: list[Any] = []
    ignored_names = list(getattr(model, "_hsdp_ignored_modules", None) or [])
    if ignored_names and target_device is None:
        raise ValueError(
            f"{type(model).__name__} declares _hsdp_ignored_modules {ignored_names} but "
            "target_device is None; pass the device those modules should live on"
        )
    for name in ignored_names:
        try:
            sub = model.get_submodule(name)
        except AttributeError:
            msg = f"_hsdp_ignored_modules names {name!r}, but {type(model).__name__} has no such submodule"
            warnings.warn(msg, stacklevel=2)
            log.warning(msg)
            continue
        ignored_modules.append(sub)
        ignored.update(p for _, p in ad.named_parameters(sub))

    unshardable = [(n, p) for n, p in named if p not in ignored and not ad.is_shardable(p)]
    if unshardable and target_device is None:
        listed = ", ".join(_describe(ad, n, p) for n, p in unshardable[:5])
        more = f" and {len(unshardable) - 5} more" if len(unshardable) > 5 else ""
        raise ValueError(
            f"{type(model).__name__} has parameters that cannot be sharded ({listed}{more}: 0-dim "
            "or not floating point); they are kept whole on every rank, so target_device must "
            "be given"
        )
    ignored.update(p for _, p in unshardable)

    for sub in ignored_modules:
        ad.move(sub, target_device)
    if target_device is not None:
        ad.place_whole(model, [p for _, p in unshardable], target_device)
    ctx = HSDPShardContext(
        model=model,
        adapter=ad,
        mesh=mesh,
        mp_policy=policy,
        reshard_after_forward=bool(hsdp_config.reshard_after_forward),
        hsdp_shard_conditions=conditions,
        ignored_params=ignored,
        target_device=target_device,
        keep_dtype_modules=keep_modules(model),
        prefetch_depth=hsdp_config.prefetch_depth,
        max_unsharded_bytes=hsdp_config.max_unsharded_bytes,
        wire_dtype=hsdp_config.wire_dtype,
        resident_bytes=hsdp_config.resident_bytes,
        buffer_device=buffers,
    )
    ctx.whole_bytes.append(_C.WholeBytes(ad.held_nbytes(ignored)))
    return ctx


def _default_context(
    model: Any,
    reshard_after_forward: bool,
    mp_policy: MixedPrecisionPolicy | None,
    mesh: DeviceMesh | None,
    conditions: list[ShardCondition],
    ignored_params: set[Any] | None,
    ad: TensorAdapter,
) -> HSDPShardContext:
    if mesh is None:
        world = distributed.init_process_group()
        mesh = init_device_mesh(device_type_of(world), (1, world.size))
    ignored = set(ignored_params or ())
    ctx = HSDPShardContext(
        model=model,
        adapter=ad,
        mesh=mesh,
        mp_policy=mp_policy or MixedPrecisionPolicy(),
        reshard_after_forward=reshard_after_forward,
        hsdp_shard_conditions=conditions,
        ignored_params=ignored,
        keep_dtype_modules=keep_modules(model),
    )
    ctx.whole_bytes.append(_C.WholeBytes(ad.held_nbytes(ignored)))
    return ctx


def shard_model(
    model: Any,
    *,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    mesh: DeviceMesh | None = None,
    hsdp_shard_conditions: Sequence[Callable[[str, Any], bool]],
    ignored_params: set[Any] | None = None,
    context: HSDPShardContext | None = None,
) -> None:
    """Make every module a condition selects a unit (children first), then the root.

    Each unit holds the parameters of its subtree that no inner unit holds, minus
    ``ignored_params``; the root holds the rest. With ``context`` given, its mesh, policy and
    ignored parameters are used.
    """
    ad = _require_module(model)
    conditions = _check_conditions(hsdp_shard_conditions, model, "hsdp_shard_conditions")
    if context is not None and context.finalized:
        raise RuntimeError("this HSDP context has already sharded its root; build a new one")
    selected = _select(model, conditions, ad)
    if context is None:
        context = _default_context(model, reshard_after_forward, mp_policy, mesh, conditions, ignored_params, ad)
    elif ignored_params:
        extra = set(ignored_params) - context.ignored_params
        context.ignored_params |= extra
        context.whole_bytes.append(_C.WholeBytes(ad.held_nbytes(extra)))
    claimed = set(context.owned)
    states = [_build_unit(context, m, n, False, claimed) for n, m in selected]
    states.append(_build_unit(context, model, "", True, claimed))
    _commit(context, states, claimed)
    _finish(model, context)


def shard_hsdp_module(module: Any, context: HSDPShardContext) -> None:
    """Make one completed child module a unit, with the prepared context."""
    _require_module(module, "module")
    if context.finalized:
        raise RuntimeError("this HSDP context has already sharded its root; build a new one")
    if module is context.model:
        raise ValueError("shard_hsdp_module got the root model; call finalize_hsdp_root(model, context) for it")
    fqn = _module_names(context.model).get(id(module))
    if fqn is None:
        raise ValueError(f"{type(module).__name__} is not a submodule of the context's model")
    if getattr(module, "_hsdp_unit", None) is not None:
        raise RuntimeError(f"module '{fqn}' is already an HSDP unit")
    ad = context.adapter
    if not ad.has_forward(module) and any(id(p) not in context.owned for _, p in ad.named_parameters(module)):
        _refuse_uncalled(fqn, module)
    claimed = set(context.owned)
    _commit(context, [_build_unit(context, module, fqn, False, claimed)], claimed)


def finalize_hsdp_root(model: Any, context: HSDPShardContext) -> None:
    """Shard what no child unit holds into the root unit; call after every child."""
    _require_module(model)
    if model is not context.model:
        raise ValueError("finalize_hsdp_root got a different model than the context was prepared for")
    if context.finalized:
        raise RuntimeError("this HSDP context has already sharded its root")
    claimed = set(context.owned)
    _commit(context, [_build_unit(context, model, "", True, claimed)], claimed)
    _finish(model, context)


def _finish(model: Any, context: HSDPShardContext) -> None:
    context.finalized = True
    context.adapter.freeze(model)
    # The full weights a model was built with are freed by now; without this, glibc keeps
    # their pages for reuse and the process stays as large as the unsharded model.
    gc.collect()
    _C.trim_memory()
    object.__setattr__(model, "_hsdp_context", context)
    log.info("Sharded %d modules + root", len(context.child_units))


def apply_hsdp_to_model(model: Any, hsdp_config: Any, target_device: Any = None) -> Any:
    """Shard a model whose weights are loaded; returns the same model, ready for inference."""
    context = prepare_hsdp_shard_context(model, hsdp_config, target_device)
    shard_model(
        model,
        reshard_after_forward=context.reshard_after_forward,
        mp_policy=context.mp_policy,
        mesh=context.mesh,
        hsdp_shard_conditions=context.hsdp_shard_conditions,
        context=context,
    )
    log.info("HSDP applied to model: %s", type(model).__name__)
    return model


# ---------------------------------------------------------------------------- explicit control


def _units_of(module: Any, recurse: bool) -> list[UnitState]:
    mods = module.modules() if recurse else [module]
    units = [u for m in mods if (u := getattr(m, "_hsdp_unit", None)) is not None]
    if not units:
        raise ValueError(f"{type(module).__name__} is not an HSDP unit" + (" and holds none" if recurse else ""))
    return units


def unshard(module: Any, *, recurse: bool = False, async_op: bool = False) -> UnitShardHandle | None:
    """Gather a unit's full weights and keep them until :func:`reshard` (forwards leave them).

    With ``recurse=True``, every unit in the module's subtree. With ``async_op=True`` the
    gathers run on the collective worker and a handle is returned; ``handle.wait()`` blocks
    until they are done (a forward of the unit also waits for them).
    """
    units = _units_of(module, recurse)
    started: list[UnitState] = []
    try:
        for u in units:
            u.unshard(async_op=True)
            started.append(u)
        handle = UnitShardHandle(*units)
        if async_op:
            return handle
        handle.wait()
    except BaseException:
        for u in started:  # all or nothing: no unit is left explicitly unsharded or in flight
            u.reshard()
        raise
    return None


def reshard(module: Any, *, recurse: bool = False) -> None:
    """Free a unit's full weights; its parameters go back to the sharded state."""
    for u in _units_of(module, recurse):
        u.reshard()


class resident:  # noqa: N801 (a context manager named like the verb users write)
    """``with hsdp.resident(model):`` gathers every unit once and keeps the full weights for
    the whole block (a denoising loop, say), then reshards on exit, also when it raises.

    It trades memory (the whole model per rank while inside) for no gathers per step.
    """

    def __init__(self, model: Any) -> None:
        self.model = model

    def __enter__(self) -> Any:
        get_units(self.model)  # a clear error for a model hsdp did not shard
        # every gather started first so they pipeline on the worker; all or nothing
        unshard(self.model, recurse=True)
        return self.model

    def __exit__(self, *exc: object) -> None:
        reshard(self.model, recurse=True)


def full_state_dict(model: Any) -> dict[str, Any]:
    """The whole model's state dict, gathered: a copy of every parameter (and, for torch,
    every persistent buffer) under its own name, in its storage dtype. One collective call on
    every rank of the job; every rank gets the full dict. The units reshard afterwards."""
    get_units(model)  # a clear error for a model hsdp did not shard
    with resident(model):
        return model._hsdp_context.adapter.copy_state_dict(model)


def get_units(model: Any) -> list[UnitState]:
    """The units of a sharded model, in the order they were made (children first, root last)."""
    ctx = getattr(model, "_hsdp_context", None)
    if ctx is None:
        raise ValueError(f"{type(model).__name__} has not been sharded by hsdp")
    return list(ctx.units)


def memory_stats() -> dict[str, Any]:
    """Bytes this process holds for hsdp, from the C core's own counters.

    ``held_bytes`` = shards + unsharded buffers in use + idle pooled buffers + parameters
    kept whole. ``buffer_allocs`` counts unsharded buffers ever allocated (a steady-state
    forward adds none); ``gathers`` the unit gathers ever started. ``resident_units`` (the
    labels) and ``resident_bytes`` are what residency budgets keep gathered across forwards
    (``resident_bytes=`` in the config; counted in ``unsharded_bytes`` once gathered).
    """
    s: dict[str, Any] = dict(_C.memory_stats())
    s["held_bytes"] = s["sharded_bytes"] + s["unsharded_bytes"] + s["pooled_bytes"] + s["whole_bytes"]
    budgeted = list(_budgeted)
    s["resident_units"] = [u.label for sch in budgeted for u in sch.resident]
    s["resident_bytes"] = sum(sch.resident_bytes for sch in budgeted)
    return s


def residency_stats(model: Any) -> dict[str, Any]:
    """A sharded model's residency and gathers: the budget (as configured and in bytes, once
    the first forward resolved it), the rule, the units it keeps gathered and their bytes,
    the gathers a forward makes and the bytes per gather, and the gathers the last forward
    actually started. Without a budget it reports no resident units and every gather."""
    get_units(model)  # a clear error for a model hsdp did not shard
    sched = model._hsdp_context.schedule
    return sched.report()


def empty_pool() -> None:
    """Release the idle unsharded buffers kept for reuse (like torch.cuda.empty_cache); the
    next forward allocates again."""
    _C.empty_pool()


def set_pool_capacity(n: int) -> None:
    """Keep at most ``n`` idle unsharded buffers for reuse (default 2; 0 keeps none, so every
    gather outside a scheduled forward allocates). A forward's schedule raises it to what a
    steady-state forward holds."""
    _C.set_pool_capacity(int(n))
