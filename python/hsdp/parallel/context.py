"""Sequence parallel for any diffusers transformer that declares a context-parallel plan
(``_cp_plan``), over hsdp's groups (torch; CPU ranks over MPI, GPUs over NCCL).

``apply_sequence_parallel_torch(model, sp)`` makes a stock diffusers model run with its tokens
split over ``sp`` (a :class:`~hsdp.parallel.Ulysses`, or a :class:`hsdp.ring.USP` for ring
attention alone or with Ulysses), with or without hsdp sharding its weights:

- **Where to split and gather: the model's plan.** diffusers 0.42 writes, per model class,
  which inputs of which submodule are split along which dimension (``ContextParallelInput``),
  which outputs are split instead (``split_output``: a rotary table computed whole), and
  where the sequence is gathered back (``ContextParallelOutput``). :class:`PlanHooks` reads it
  and installs torch forward hooks that split with ``tensor_split`` (uneven lengths allowed:
  [Note: lengths] in :mod:`hsdp.parallel.attention`) and gather with hsdp's all-gather.
- **Which attention calls exchange tokens: the model's processors.** diffusers' processors
  pass their ``_parallel_config`` to ``dispatch_attention_fn`` for the calls that attend over
  the split sequence, and None for the others (Wan's cross-attention: its keys are the text,
  whole on every rank). hsdp sets that attribute to a
  :class:`~hsdp.parallel.attention.SequenceParallelAttention` and routes the dispatcher's calls
  that carry one to it (:func:`route`); every other call, in this model or any other, goes
  to diffusers' dispatcher untouched.

[Note: the seam] This is diffusers' own design (``ModelMixin.enable_parallelism``), run over
hsdp's groups instead of ``torch.distributed``: hsdp's world is its own MPI or NCCL
communicator, and its ring passes blocks point to point rather than all-gathering them. A
model class without a plan gets one with :func:`register_plan` (the plan format is
diffusers', ``diffusers.models._modeling_parallel``). Imported only by callers, so ``import
hsdp`` never pulls torch in.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch

from ..adapters.torch import outside_graphs
from .attention import _TORCH, SequenceParallelAttention, all_gather_tokens
from .cfg import cfg_combine as _cfg_combine
from .groups import ParallelGroups

PLANS: dict[type, dict[str, Any]] = {}
"""Context-parallel plans hsdp uses for classes that declare none (:func:`register_plan`)."""

_ORIGINAL: Callable[..., torch.Tensor] | None = None  # diffusers' dispatch_attention_fn, before routing


def register_plan(cls: type, plan: dict[str, Any]) -> None:
    """Give `cls` (a diffusers model class) the context-parallel plan `plan`, in diffusers'
    ``_cp_plan`` format, for hsdp's sequence parallel; a plan the class declares itself wins."""
    if not isinstance(plan, dict) or not plan:
        raise TypeError(f"a context-parallel plan is a non-empty dict of module names, got {plan!r}")
    PLANS[cls] = plan


def plan_of(cls: type) -> dict[str, Any] | None:
    """The plan hsdp uses for `cls`: its own ``_cp_plan``, else one :func:`register_plan` gave."""
    own = getattr(cls, "_cp_plan", None)
    if own:
        return own
    for klass in cls.__mro__:
        if klass in PLANS:
            return PLANS[klass]
    return None


def no_plan_message(class_name: str, what: str) -> str:
    return (f"{what} needs the model's context-parallel plan, and {class_name} declares none (no _cp_plan); "
            f"give it one with hsdp.parallel.context.register_plan({class_name}, {{...}}) in diffusers' _cp_plan "
            f"format (diffusers.models._modeling_parallel: the inputs to split, the outputs to gather), "
            f"and route its attention through diffusers' dispatch_attention_fn")


# ------------------------------------------------------------------------------------ routing


def route(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
          dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
          attention_kwargs: dict[str, Any] | None = None, *, backend: Any = None, parallel_config: Any = None
          ) -> torch.Tensor:
    """diffusers' ``dispatch_attention_fn``, with the calls that carry hsdp's
    :class:`SequenceParallelAttention` as their parallel config sent to it."""
    assert _ORIGINAL is not None
    if isinstance(parallel_config, SequenceParallelAttention):
        if attention_kwargs:
            raise NotImplementedError(f"sequence parallel attention with backend arguments {sorted(attention_kwargs)}")
        return parallel_config(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend)
    return _ORIGINAL(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, attention_kwargs,
                     backend=backend, parallel_config=parallel_config)


def _install_route(module_name: str) -> bool:
    """Route `module_name`'s ``dispatch_attention_fn`` (the name its processors call); False
    when it has none."""
    global _ORIGINAL
    from diffusers.models import attention_dispatch

    if _ORIGINAL is None:
        _ORIGINAL = attention_dispatch.dispatch_attention_fn
    module = sys.modules.get(module_name)
    fn = getattr(module, "dispatch_attention_fn", None)
    if fn is route:
        return True
    if fn is not _ORIGINAL:
        return False
    module.dispatch_attention_fn = route  # type: ignore[union-attr]
    return True


# ------------------------------------------------------------------------------------ the plan


def _modules(model: Any, name: str) -> list[Any]:
    """The submodules a plan key names ('' the model, 'blocks.*' every block, 'blocks.0.attn')."""
    found = [model]
    for atom in name.split(".") if name else []:
        nxt = []
        for m in found:
            if atom == "*":
                if not isinstance(m, torch.nn.ModuleList):
                    raise ValueError(f"context-parallel plan key {name!r}: '*' stands for the items of a "
                                     f"ModuleList, not of a {type(m).__name__}")
                nxt.extend(m)
            elif hasattr(m, atom):
                nxt.append(getattr(m, atom))
            else:
                raise ValueError(f"context-parallel plan key {name!r}: '{atom}' is not a submodule of "
                                 f"{type(m).__name__}")
        found = nxt
    return found


class PlanHooks:
    """The forward hooks that split and gather one model's sequence where its plan says."""

    def __init__(self, model: Any, plan: dict[str, Any], sp: Any, attention: SequenceParallelAttention) -> None:
        from diffusers.models._modeling_parallel import (
            ContextParallelInput,
            ContextParallelOutput,
        )

        self.sp = sp
        self.attention = attention
        self.model_name = type(model).__name__
        self.routed = False  # a forward has routed attention calls: the processors are hsdp's
        self.handles: list[Any] = []
        # the model's own forward starts a new forward: every split so far even, no call yet
        # every hook runs eagerly under torch.compile, a graph break ([Note: compile] in
        # hsdp.adapters.torch): they count and gather over the group, state no graph may hold
        self.handles.append(model.register_forward_pre_hook(outside_graphs(self._start), prepend=True))
        for name, entry in plan.items():
            for module in _modules(model, name):
                if isinstance(entry, dict):
                    inputs = {k: v for k, v in entry.items() if not _split_output(v)}
                    outputs = {k: v for k, v in entry.items() if _split_output(v)}
                    if inputs:
                        self.handles.append(module.register_forward_pre_hook(
                            outside_graphs(self._split_inputs(name, module, inputs, ContextParallelInput)),
                            with_kwargs=True))
                    if outputs:
                        self.handles.append(module.register_forward_hook(outside_graphs(self._split_outputs(name, outputs))))
                else:
                    specs = [entry] if isinstance(entry, ContextParallelOutput) else list(entry)
                    self.handles.append(module.register_forward_hook(outside_graphs(self._gather_outputs(name, specs))))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _start(self, module: Any, args: Any) -> None:
        self.attention.even = True
        self.attention.calls = 0

    def split(self, x: torch.Tensor, dim: int, where: str) -> torch.Tensor:
        """This rank's part of `x` along `dim` (tensor_split's: the first ranks one longer)."""
        n, p = x.shape[dim], self.sp.degree
        if n < p:
            raise ValueError(f"sequence parallel over {p} ranks: {where} has {n} tokens along dim {dim}, fewer "
                             f"than the ranks; use a sequence-parallel degree of at most {n}, or a longer input")
        if n % p:
            self.attention.even = False
        return x.tensor_split(p, dim=dim)[self.sp.rank]

    def _split_one(self, x: Any, spec: Any, where: str) -> Any:
        if not isinstance(x, torch.Tensor) or (spec.expected_dims is not None and x.dim() != spec.expected_dims):
            return x  # as diffusers: an input of another rank (Wan's 1-D timestep) stays whole
        return self.split(x, spec.split_dim, where)

    def _split_inputs(self, name: str, module: Any, specs: dict[str, Any], input_cls: type) -> Callable[..., Any]:
        params = list(inspect.signature(type(module).forward).parameters)[1:]
        index = {p: i for i, p in enumerate(params)}
        for arg in specs:
            if arg not in index:
                raise ValueError(f"context-parallel plan of {self.model_name}: {type(module).__name__}.forward "
                                 f"('{name}') has no parameter '{arg}'")

        def hook(mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            args = list(args)  # type: ignore[assignment]
            for arg, spec in specs.items():
                where = f"input '{arg}' of '{name or self.model_name}'"
                if arg in kwargs:
                    kwargs[arg] = self._split_value(kwargs[arg], spec, where, input_cls)
                elif index[arg] < len(args):
                    args[index[arg]] = self._split_value(args[index[arg]], spec, where, input_cls)  # type: ignore[index]
            return tuple(args), kwargs

        return hook

    def _split_value(self, value: Any, spec: Any, where: str, input_cls: type) -> Any:
        if isinstance(value, (list, tuple)):
            specs = [spec] * len(value) if isinstance(spec, input_cls) else list(spec)
            return type(value)(self._split_one(x, s, f"{where}[{i}]") for i, (x, s) in enumerate(zip(value, specs)))
        return self._split_one(value, spec, where)

    def _split_outputs(self, name: str, specs: dict[int, Any]) -> Callable[..., Any]:
        def hook(mod: Any, args: Any, output: Any) -> Any:
            single = isinstance(output, torch.Tensor)
            outs = [output] if single else list(output)
            for i, spec in specs.items():
                outs[i] = self._split_one(outs[i], spec, f"output {i} of '{name}'")
            return outs[0] if single else type(output)(outs)

        return hook

    def _gather_outputs(self, name: str, specs: list[Any]) -> Callable[..., Any]:
        def hook(mod: Any, args: Any, output: Any) -> Any:
            # Checked until one forward routed its attention: a later forward may route none
            # (a step cache that skipped the blocks), the first computes them all.
            if self.attention.calls:
                self.routed = True
            elif not self.routed:
                raise RuntimeError(
                    f"sequence parallel: {self.model_name} ran a forward with its tokens split and no attention call "
                    f"reached hsdp's router; its attention processors must call diffusers' dispatch_attention_fn "
                    f"with their _parallel_config (a custom processor set with set_attn_processor does not)")
            single = isinstance(output, torch.Tensor)
            outs = [output] if single else list(output)
            for i, spec in enumerate(specs):
                if spec is not None:
                    outs[i] = self.gather(outs[i], spec.gather_dim)
            return outs[0] if single else type(output)(outs)

        return hook

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's part of `x` along `dim`, whole, in rank order."""
        p = self.sp.degree
        if self.attention.even:
            lens = [x.shape[dim]] * p
        else:
            mine = torch.tensor([x.shape[dim]], dtype=torch.int64, device=x.device)
            lens = [int(n) for n in _TORCH.all_gather(self.sp.group, mine).cpu().flatten().tolist()]
        return all_gather_tokens(self.sp.group, x.contiguous(), lens, dim)


def _split_output(entry: Any) -> bool:
    first = entry[0] if isinstance(entry, (list, tuple)) else entry
    return bool(getattr(first, "split_output", False))


def _processors(model: Any) -> list[tuple[str, Any]]:
    return [(name, m.processor) for name, m in model.named_modules() if hasattr(m, "processor")
            and hasattr(type(m.processor), "_parallel_config")]


def apply_sequence_parallel_torch(model: Any, sp: Any) -> Any:
    """Run the diffusers model `model` with its tokens split over `sp` (see the module
    docstring). In place; returns the model. Works on a model hsdp has sharded."""
    plan = plan_of(type(model))
    if plan is None:
        raise NotImplementedError(no_plan_message(type(model).__name__, "sequence parallel"))
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    if heads is not None:
        sp.check_heads(int(heads))
    processors = _processors(model)
    if not processors:
        raise NotImplementedError(f"sequence parallel: {type(model).__name__} has no attention processor with a "
                                  f"_parallel_config (diffusers' dispatcher processors), so none can run over "
                                  f"the split sequence")
    for name, proc in processors:
        if not _install_route(type(proc).__module__):
            raise NotImplementedError(
                f"sequence parallel: the attention processor of '{name}' ({type(proc).__name__}, module "
                f"{type(proc).__module__}) does not call diffusers' dispatch_attention_fn, so hsdp cannot route it")
    from .attention import SequenceParallelAttention as _SPA

    attention = _SPA(sp, _ORIGINAL)  # type: ignore[arg-type]
    for _, proc in processors:
        proc._parallel_config = attention
    hooks = PlanHooks(model, plan, sp, attention)
    object.__setattr__(model, "_hsdp_sequence_parallel", hooks)
    return model


def cfg_combine(groups: ParallelGroups, branch: Callable[[int], torch.Tensor], guidance_scale: float) -> torch.Tensor:
    """:func:`hsdp.parallel.cfg_combine` on torch tensors (on the GPU through NCCL):
    uncond + scale * (cond - uncond) in float32, the same on every rank."""
    return _cfg_combine(groups, branch, guidance_scale, _TORCH)
