"""The engine's port to a framework, the tensor adapter protocol: everything hsdp needs from a
framework, in one place.

The API (``api.py``), the hooks (``units.py``), the schedule and the checkpoint loader reach
a framework's modules and parameters only through these methods, so supporting a framework
is one new file in ``hsdp.adapters``. The protocol lives here, on the side of the engine that
uses it (the adapters implement it; ``hsdp.adapters.base`` re-exports it). The NumPy runtime
(``hsdp.nn``) is the first implementation; a torch adapter is the second.

Where the C unit can bind views itself (``bind_attr`` is not None), it sets that attribute
of every parameter to a zero-copy NumPy view of the gathered buffer in one C pass, with no
Python loop on the hot path. An adapter whose tensors are not NumPy arrays leaves
``bind_attr`` None and implements :meth:`TensorAdapter.bind` / :meth:`TensorAdapter.unbind`
from the unit's buffers (``Unit.buffers()``, ``Unit.view_specs``), which export their bytes
through the buffer protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from .dtypes import DType

if TYPE_CHECKING:
    from .units import UnitState


class TensorAdapter(Protocol):
    """A framework as hsdp sees it. Every method is called by hsdp, never by users."""

    name: str
    # The attribute the C unit sets to each parameter's NumPy view, or None: then bind() and
    # unbind() do the binding.
    bind_attr: str | None

    # -- modules ---------------------------------------------------------------------------
    def owns(self, module: Any) -> bool:
        """Whether ``module`` is one of this framework's modules."""

    def named_parameters(self, module: Any, remove_duplicate: bool = True) -> Iterator[tuple[str, Any]]:
        """(name, parameter) of ``module`` and its descendants: each parameter once, or under
        every name it has (tied weights) with ``remove_duplicate=False``."""

    def has_forward(self, module: Any) -> bool:
        """Whether ``module`` is ever called: False for a container with no forward of its own
        (a ModuleList), whose hooks would never run, so it cannot be a unit."""

    def named_buffers(self, module: Any) -> list[tuple[str, Any]]:
        """The persistent buffers of ``module`` (those its state dict, and so a checkpoint,
        holds): loaded whole on every rank, like the parameters kept whole."""

    def add_hooks(self, module: Any, pre: Callable[..., Any], post: Callable[..., Any]) -> list[Any]:
        """Installs a forward pre-hook ``pre(module, args, kwargs) -> (args, kwargs) | None``
        and a post-hook ``post(module, args, kwargs, output) -> output | None`` that also
        runs when the forward raises. Returns handles with ``remove()``."""

    def move(self, module: Any, device: Any) -> None:
        """Moves a module that is kept whole (an ignored module) to ``device``."""

    def place_whole(self, model: Any, params: Iterable[Any], device: Any) -> None:
        """Moves ``params`` (kept whole) and every buffer of ``model`` to ``device``; the
        parameters to be sharded stay where they are (they are copied to their shards)."""

    def freeze(self, module: Any) -> None:
        """Turns off ``requires_grad`` on every parameter: inference only."""

    def copy_state_dict(self, module: Any) -> dict[str, Any]:
        """A copy of the module's state dict (name -> tensor), taken while every unit is
        unsharded: what ``hsdp.full_state_dict`` returns."""

    # -- parameters ------------------------------------------------------------------------
    def dtype(self, p: Any) -> DType:
        """The parameter's logical dtype (its storage dtype while sharded)."""

    def shape(self, p: Any) -> tuple[int, ...]:
        ...

    def is_shardable(self, p: Any) -> bool:
        """Floating point with at least one dimension; others are kept whole."""

    def is_sharded(self, p: Any) -> bool:
        """Whether hsdp already holds ``p`` in a unit."""

    def shard_source(self, p: Any) -> tuple[Any, str | None] | None:
        """A C-contiguous NumPy array of the values (and the dtype name its raw elements
        hold, when it is not the array's own dtype), or None for a meta parameter."""

    def values(self, p: Any) -> Any:
        """What ``p`` holds now, in a form :meth:`restore` takes back (None when empty)."""

    def assign(self, p: Any, array: Any) -> None:
        """Fills a parameter kept whole, or a buffer, from a NumPy array read from a
        checkpoint."""

    def restore(self, p: Any, saved: Any) -> None:
        """Puts back what :meth:`values` returned (undoing a failed load)."""

    def unloaded(self, module: Any) -> list[str]:
        """Names of the parameters (not held by hsdp) and buffers of ``module`` that hold no
        values (meta): after a load, each is an error, never silent garbage."""

    def held_nbytes(self, params: Iterable[Any]) -> int:
        """Bytes these parameters occupy in memory while held whole."""

    def mark_sharded(self, params: tuple[Any, ...], dtypes: tuple[DType, ...], state: str, device: str) -> None:
        """Switches parameters to the sharded state: no values, the storage dtype, and
        ``state`` as the message any use outside the unit's forward raises. ``device`` is
        where the unit's unsharded buffers live ('host', or the group's device: 'cuda')."""

    # -- dtypes and devices ----------------------------------------------------------------
    def compute_dtype(self, storage: DType) -> DType:
        """The dtype a parameter stored in ``storage`` is computed in (NumPy widens
        bfloat16 and float8 to float32; torch computes in them)."""

    def check_device(self, target_device: Any) -> None:
        """Raises ValueError naming ``target_device`` when this framework cannot use it."""

    def device_type(self, target_device: Any) -> str | None:
        """The framework device type views for ``target_device`` have ('cpu', 'cuda'; None
        when this framework binds host memory only): the process group's device decides from
        it where unsharded buffers live (hsdp.world.devices.buffer_device). Called before anything
        else uses ``target_device``: raises ValueError naming a value that is no device (the
        rest of :meth:`check_device` may need the process group first)."""

    # -- forwards --------------------------------------------------------------------------
    def cast_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: DType) -> tuple[Any, Any] | None:
        """Floating tensors in (nested) args and kwargs cast to ``dtype``: the new (args,
        kwargs), or None when nothing changes (the hook then leaves the inputs alone)."""

    def cast_output(self, output: Any, dtype: DType) -> Any:
        """Floating tensors in a (nested) output cast to ``dtype``."""

    # -- exchanges (hsdp.parallel writes each exchange once over these) ---------------------
    def permute(self, t: Any, axes: tuple[int, ...]) -> Any:
        """``t`` with its axes in the order ``axes`` (a view where the framework makes one)."""

    def to_float32(self, t: Any) -> Any:
        """``t`` as a contiguous float32 tensor (itself when it already is one)."""

    def all_gather(self, group: Any, send: Any) -> Any:
        """Every rank's ``send`` of the process group ``group``, stacked in rank order: a new
        tensor ``(group.size, *send.shape)`` on ``send``'s device."""

    def all_to_all(self, group: Any, send: Any) -> Any:
        """Block ``j`` (along the first axis, ``group.size`` blocks) of ``send`` to rank ``j``;
        block ``i`` of the result, a new tensor of ``send``'s shape, is what rank ``i`` sent."""

    # -- binding (only when bind_attr is None) -----------------------------------------------
    def bind(self, state: UnitState) -> None:
        """Points every parameter of a unit that has just unsharded at a zero-copy view."""

    def unbind(self, state: UnitState) -> None:
        """Drops those views (before the unit gives its buffers back)."""
