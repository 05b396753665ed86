"""A sharded module's unit: the C unit that holds its flat shard, and the forward hooks.

The hot path is two C calls per unit per forward (``Unit.unshard`` and ``Unit.reshard``).
With an adapter whose views the C unit binds (``bind_attr``), they set every parameter's
view themselves, so there is no per-parameter Python loop; other adapters bind after the
gather and unbind before the reshard. Everything framework-specific goes through the
unit's adapter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import _C
from . import trace
from .dtypes import DType
from .policy import MixedPrecisionPolicy
from .schedule import Schedule

if TYPE_CHECKING:
    from .port import TensorAdapter

# What a sharded module keeps in its __dict__: leaf name -> callback taking the Parameter
# that replaces it (UnitState.commit installs it; hsdp.nn.Module and the torch adapter call it).
PARAM_WATCH = "_hsdp_param_watch"


class UnitState:
    """One sharded module: its parameters, its C unit and its hooks."""

    def __init__(
        self,
        module: Any,
        fqn: str,
        unit: _C.Unit,
        params: tuple[Any, ...],
        names: tuple[str, ...],
        storage_dtypes: tuple[DType, ...],
        reshard_after_forward: bool,
        policy: MixedPrecisionPolicy,
        is_root: bool,
        adapter: TensorAdapter,
        input_dtype: DType | None,
    ) -> None:
        self.module = module
        self.adapter = adapter
        self._binds = adapter.bind_attr is None  # the adapter binds views, not the C unit
        self._bound = False
        self.adapter_data: Any = None  # what the adapter keeps per unit (its view layout, say)
        self.fqn = fqn
        self.unit = unit
        self.params = params
        self.names = names
        self.storage_dtypes = storage_dtypes
        self.reshard_after_forward = reshard_after_forward
        self.policy = policy
        self.is_root = is_root
        # what the pre-forward casts floating inputs to (None: no cast); see policy.unit_input_dtype
        self._input_dtype = input_dtype
        self._output_dtype = policy.output_dtype if is_root else None
        # Set by an explicit hsdp.unshard() (or hsdp.resident): forwards then leave the
        # unit unsharded until hsdp.reshard().
        self._explicit = False
        self._handles: list[Any] = []
        self.schedule: Schedule | None = None  # shared by the units of one model
        # a float8 wire adds the buffer its encodings arrive in, held while a gather runs
        self.full_bytes = unit.total_bytes + unit.widened_bytes + unit.wire_bytes
        # pool keys: host buffers by size, device buffers by (size, device)
        self.buffer_sizes: tuple[Any, ...] = tuple(
            n if unit.device == "host" else (n, unit.device)
            for n in (unit.total_bytes, unit.widened_bytes, unit.wire_bytes) if n
        )
        # Set when a load into this unit failed: the model must not run on partial weights.
        self.broken: str | None = None

    @property
    def label(self) -> str:
        return self.fqn or "<root>"

    def commit(self) -> None:
        """Switch the parameters to their sharded state and install the hooks."""
        state = f"sharded by hsdp in unit '{self.label}'"
        self.adapter.mark_sharded(self.params, self.storage_dtypes, state, self.unit.device)
        self._handles.extend(self.adapter.add_hooks(self.module, self._pre_forward, self._post_forward))
        object.__setattr__(self.module, "_hsdp_unit", self)
        self._watch_replacements()

    def _watch_replacements(self) -> None:
        """Each owning module learns, in its __dict__, to tell this unit when one of its
        sharded parameters is replaced by another Parameter: the unit holds the old one's
        shard, so it refuses to run instead of computing with weights it does not hold."""
        prefix = f"{self.fqn}." if self.fqn else ""
        for p, full in zip(self.params, self.names):
            owner_name, _, leaf = full[len(prefix):].rpartition(".")
            owner = self.module.get_submodule(owner_name)

            def replaced(new: Any, old: Any = p, name: str = full) -> None:
                if new is not old:
                    self.mark_broken(
                        f"parameter '{name}' was replaced by another Parameter after sharding; the unit holds "
                        "the shard of the one it replaced, so it would run with weights it does not have. Put "
                        "the original back, or shard the model again"
                    )

            owner.__dict__.setdefault(PARAM_WATCH, {})[leaf] = replaced

    def mark_broken(self, reason: str) -> None:
        """Makes every later use of this unit raise `reason` (a failed load, say)."""
        self.broken = reason
        self._reshard_unit()

    def _check(self) -> None:
        if self.broken is not None:
            raise RuntimeError(f"unit '{self.label}' is unusable: {self.broken}")

    def _pre_forward(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.broken is not None:
            self._check()
        sched = self.schedule
        in_forward = False
        if sched is not None:
            if self.is_root:
                sched.begin()
            in_forward = sched.in_forward
            if in_forward:
                sched.enter(self)  # records the order, or notices a departure from it
        if not self.unit.is_unsharded or (self._binds and not self._bound):
            self._unshard_unit()  # waits for a prefetched gather, or gathers now; binds
        if in_forward:
            sched.prefetch()  # the next units gather while this one computes
        if trace.enabled:
            trace.compute_begin(self)
        if self._input_dtype is not None:
            return self.adapter.cast_inputs(args, kwargs, self._input_dtype)
        return None

    def _post_forward(self, module: Any, args: Any, kwargs: Any, output: Any) -> Any:
        if trace.enabled:
            trace.compute_end(self)
        sched = self.schedule
        in_forward = sched is not None and sched.in_forward
        if in_forward:
            sched.leave(self)
        if self.reshard_after_forward and not self._explicit:
            self._reshard_unit()
        if in_forward and self.is_root:
            sched.end()
        if self._output_dtype is not None:
            return self.adapter.cast_output(output, self._output_dtype)
        return None

    def release_prefetch(self) -> None:
        """A prefetched unit the forward did not reach: give its buffers back."""
        if not self._explicit:
            self._reshard_unit()

    def unshard(self, async_op: bool = False) -> "UnitShardHandle | None":
        self._check()
        self._explicit = True
        if async_op:
            self.unit.start_unshard()
            return UnitShardHandle(self)
        self._unshard_unit()
        return None

    def reshard(self) -> None:
        self._explicit = False
        self._reshard_unit()

    # ---------------------------------------------------------------- the C unit, bound

    def _unshard_unit(self) -> None:
        """Gathers (or waits for the gather in flight) and binds the views."""
        unit = self.unit
        if trace.enabled:
            t0 = _C.now_ns()
            prefetched = unit.is_pending
            unit.unshard()
            trace.record_unshard(self, t0, _C.now_ns(), prefetched)
        else:
            unit.unshard()
        if self._binds and not self._bound:
            self._bind()

    def _wait_unit(self) -> None:
        """Waits for an explicitly started gather and binds the views."""
        self.unit.wait()
        if self._binds and not self._bound and self.unit.is_unsharded:
            self._bind()

    def _bind(self) -> None:
        try:
            self.adapter.bind(self)
        except BaseException:
            self.adapter.unbind(self)  # no parameter keeps a view from a half-done bind
            raise
        self._bound = True

    def _reshard_unit(self) -> None:
        """Unbinds (so no view of ours keeps the buffers from the pool) and reshards."""
        if self._bound:
            self._bound = False
            self.adapter.unbind(self)
        self.unit.reshard()

    def __repr__(self) -> str:
        return f"UnitState({self.label!r}, params={len(self.params)}, {self.unit!r})"


class UnitShardHandle:
    """Returned by ``hsdp.unshard(module, async_op=True)``: the gather runs on the collective
    worker; ``wait()`` blocks until it is done and the parameters are bound."""

    def __init__(self, *units: UnitState) -> None:
        self._units = units

    def wait(self) -> None:
        for u in self._units:
            u._wait_unit()

    def is_completed(self) -> bool:
        return not any(u.unit.is_pending for u in self._units)


ShardCondition = Callable[[str, Any], bool]
