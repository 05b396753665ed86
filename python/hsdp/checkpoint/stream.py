"""Streaming rank-local load: shard each block, then fill its shard straight from the file.

For every unit (blocks children first, then the root) a rank preads exactly the bytes of
its own chunk of the flat layout (``Unit.read``, in C, GIL released, cast to the storage
dtype through a bounded buffer), so no full tensor of a sharded parameter ever exists on a
rank: the peak is this rank's shards plus what is kept whole, plus a few MiB.

With replicas (R > 1) only replica 0 reads; the shard is then broadcast over the replicate
group, so the file is read once per shard position instead of R times.

After every step the ranks agree (a small all-gather over the world) on whether it worked:
a failure on one rank (an I/O error, say) becomes an error on every rank, not a rank left
waiting in a collective, and every unit already made is marked unusable.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from ..world import distributed
from ..adapters import adapter_for
from ..engine.api import _check_config, _select, finalize_hsdp_root, prepare_hsdp_shard_context, shard_hsdp_module
from ..engine.units import UnitState
from .errors import in_context, shown
from .index import Checkpoint, CheckpointPath, open_checkpoint
from .plan import KeyMap, LoadPlan, plan_load
from .progress import LoadReport, Progress, ProgressArg, set_report
from .whole import read_tensor

log = logging.getLogger("hsdp")

_MSG = 1024  # bytes of an error message shared with the other ranks


class _Agreement:
    """One fixed-size all-gather per step: [ok flag | bytes read | error message]."""

    def __init__(self, world: Any) -> None:
        self.world = world
        self.send = np.zeros(16 + _MSG, dtype=np.uint8)
        self.recv = np.zeros(world.size * self.send.size, dtype=np.uint8)

    def __call__(self, err: BaseException | None, nbytes: int, step: str) -> int:
        """Returns the bytes read by all ranks in this step; raises on every rank if any failed."""
        self.send[:] = 0
        self.send[0] = 0 if err is None else 1
        self.send[8:16] = np.frombuffer(np.uint64(nbytes).tobytes(), dtype=np.uint8)
        if err is not None:
            msg = f"{type(err).__name__}: {err}".encode("utf-8", "replace")[:_MSG]
            self.send[16 : 16 + len(msg)] = np.frombuffer(msg, dtype=np.uint8)
        self.world.all_gather(self.send, self.recv)
        rows = self.recv.reshape(self.world.size, -1)
        if err is not None:
            raise err
        failed = [r for r in range(self.world.size) if rows[r, 0]]
        if failed:
            r = failed[0]
            text = rows[r, 16:].tobytes().rstrip(b"\0").decode("utf-8", "replace")
            others = f" (and on ranks {failed[1:]})" if len(failed) > 1 else ""
            raise RuntimeError(f"{step} failed on rank {r}{others}: {text}")
        return int(rows[:, 8:16].copy().view(np.uint64).sum())


def _step(agree: _Agreement, step: str, fn: Any) -> tuple[Any, int]:
    """Runs fn() -> (result, bytes read) on this rank, then agrees with the others."""
    err: BaseException | None = None
    result, nbytes = None, 0
    try:
        result, nbytes = fn()
    except Exception as e:  # KeyboardInterrupt and the like end the job instead
        err = e
    return result, agree(err, nbytes, step)


def _fill(st: UnitState, plan: LoadPlan) -> int:
    """Pread this rank's part of every parameter of the unit; returns the bytes read."""
    fn = st.unit.read
    n = 0
    for i, p in enumerate(st.params):
        e = plan.entry(p)
        try:
            n += fn(i, e.file.fd, e.offset, e.dtype.name)
        except Exception as exc:
            raise in_context(exc, f"{e.where} (parameter '{st.names[i]}' of unit '{st.label}')") from exc
    return n


def _blocks(model: Any, ctx: Any) -> list[tuple[str, Any]]:
    """The modules shard_model would make units, children first (same conditions)."""
    return _select(model, ctx.hsdp_shard_conditions, ctx.adapter)


class _Loader:
    def __init__(self, plan: LoadPlan, ctx: Any, agree: _Agreement, prog: Progress, every_replica: bool) -> None:
        self.plan, self.ctx, self.agree, self.prog = plan, ctx, agree, prog
        mesh = ctx.mesh
        self.broadcast = mesh.shape[0] > 1 and not every_replica
        self.reads = not self.broadcast or mesh.replicate_rank == 0
        self.bytes_read = 0
        # (parameter, what it held before) for every parameter filled whole: undone on failure
        self.filled_whole: list[tuple[Any, Any]] = []

    def load_whole(self) -> None:
        """Ignored and unshardable parameters: every rank reads them whole (they are kept
        whole on every rank anyway)."""

        def run() -> tuple[None, int]:
            buffers = {id(b) for _, b in self.ctx.adapter.named_buffers(self.ctx.model)}
            items = [it for it in self.plan.items if it.param in self.ctx.ignored_params or id(it.param) in buffers]
            # Every read first, so a short read changes no parameter at all.
            values = [read_tensor(it.entry) for it in items]
            ad = self.ctx.adapter
            for it, value in zip(items, values):
                self.filled_whole.append((it.param, ad.values(it.param)))
                ad.assign(it.param, value)
            n = sum(it.entry.nbytes for it in items)
            self.bytes_read += n
            return None, n

        _, total = _step(self.agree, "loading the parameters kept whole", run)
        self.prog.advance(total, count=0)

    def unit(self, label: str, make: Any) -> None:
        local = 0

        def run() -> tuple[UnitState | None, int]:
            nonlocal local
            before = len(self.ctx.units)
            make()
            st = self.ctx.units[-1] if len(self.ctx.units) > before else None
            local = _fill(st, self.plan) if st is not None and self.reads else 0
            return st, local

        st, total = _step(self.agree, f"loading unit '{label}'", run)
        if st is not None and self.broadcast:
            st.unit.broadcast_shard(self.ctx.mesh.replicate_group, 0)
        if st is not None:
            st.unit.encode()  # a float8 wire: the loaded shard becomes its encoding (no-op without one)
        self.bytes_read += local
        self.prog.advance(total)

    def fail(self, exc: BaseException) -> None:
        reason = f"loading '{self.plan.checkpoint.path}' failed: {type(exc).__name__}: {exc}"
        for st in self.ctx.units:
            st.mark_broken(reason)
        for p, before in reversed(self.filled_whole):
            self.ctx.adapter.restore(p, before)  # as it was (meta: None): nothing half-loaded stays behind


def load_model_sharded(
    model: Any,
    checkpoint: CheckpointPath | Checkpoint,
    hsdp_config: Any,
    target_device: Any = None,
    *,
    key_map: KeyMap | None = None,
    progress: ProgressArg = True,
    read_on_every_replica: bool = False,
    strict: bool = True,
) -> Any:
    """Shard ``model`` (built under ``hsdp.nn.meta_init()``) and load it from a safetensors
    checkpoint, block by block, each rank reading only its own shard. Returns the model.

    ``checkpoint`` is a ``.safetensors`` file, a ``*.index.json``, a directory holding one,
    or an open :class:`Checkpoint`. ``key_map(checkpoint_name) -> model_name | None`` (or a
    dict) renames tensors; None skips one. ``progress`` logs on rank 0 (or is called there
    with a :class:`LoadProgress` after every unit). With replicas, replica 0 reads and
    broadcasts unless ``read_on_every_replica``. ``strict`` (the default) refuses a file
    whose tensors leave gaps or trailing bytes in its data section, as the reference
    safetensors package does; ``strict=False`` accepts them (overlaps are always refused).

    Missing and unexpected names raise one :class:`CheckpointKeyError` listing them; shape
    and dtype mismatches raise :class:`CheckpointError` naming each tensor; both before any
    data is read. A failure during the load raises on every rank and leaves every unit made
    so far unusable (its forward raises), never a half-loaded model that runs.
    """
    _check_config(hsdp_config)  # before the process group starts or a file opens
    framework = adapter_for(model).device_type(target_device)  # a ValueError naming a bad target_device
    # the backend the device needs (NCCL for 'cuda', even under mpiexec), decided in world/
    world = distributed.world_for(framework, f"target_device {target_device!r}")
    agree = _Agreement(world)
    own = not isinstance(checkpoint, Checkpoint)

    # Every rank validates; they agree before the mesh's first collective, so a rank that
    # cannot open the file fails the job instead of leaving the others waiting.
    err: Exception | None = None
    ckpt: Checkpoint | None = None if own else checkpoint
    try:
        if ckpt is None:
            ckpt = open_checkpoint(checkpoint, strict=strict)  # type: ignore[arg-type]
        plan = plan_load(model, ckpt, key_map)
    except Exception as e:
        err = e
    try:
        agree(err, 0, f"validating checkpoint '{shown(str(checkpoint))}'")
    except BaseException:
        if own and ckpt is not None:
            ckpt.close()
        raise
    assert ckpt is not None
    try:
        return _load(model, plan, hsdp_config, target_device, agree, progress, read_on_every_replica)
    finally:
        if own:
            ckpt.close()


def _load(
    model: Any,
    plan: LoadPlan,
    cfg: Any,
    target_device: Any,
    agree: _Agreement,
    progress: ProgressArg,
    every_replica: bool,
) -> Any:
    ctx = prepare_hsdp_shard_context(model, cfg, target_device)
    blocks = _blocks(model, ctx)
    t0 = time.perf_counter()
    total = plan.nbytes(it.param for it in plan.items)
    prog = Progress(plan.checkpoint.path, len(blocks) + 1, total, progress)
    loader = _Loader(plan, ctx, agree, prog, every_replica)
    try:
        loader.load_whole()
        for name, block in blocks:
            loader.unit(name, lambda b=block: shard_hsdp_module(b, ctx))
        loader.unit("<root>", lambda: finalize_hsdp_root(model, ctx))
    except BaseException as e:
        loader.fail(e)
        raise
    left = ctx.adapter.unloaded(model)
    if left:
        listed = ", ".join(repr(n) for n in left[:8]) + (f" and {len(left) - 8} more" if len(left) > 8 else "")
        err = RuntimeError(
            f"after loading '{plan.checkpoint.path}', {type(model).__name__} still has tensors with no values "
            f"(meta): {listed}. Buffers no checkpoint holds (RoPE tables, say) must be real before loading: "
            "build the model under accelerate.init_empty_weights() (which keeps buffers) rather than "
            "torch.device('meta')"
        )
        loader.fail(err)
        raise err
    prog.finish()
    units = len(ctx.units)
    seconds = time.perf_counter() - t0
    set_report(model, LoadReport(plan.checkpoint.path, "streaming", units, loader.bytes_read, prog.bytes_read, seconds))
    log.info("HSDP applied to model: %s", type(model).__name__)  # the line apply_hsdp_to_model logs
    return model
