"""Whole tensors: for parameters kept whole on every rank (ignored and unshardable ones), for
``load_checkpoint`` and for the load-everything-then-shard strategy that streaming is
measured against (every rank then holds the full model once)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .. import _C
from ..adapters import adapter_for
from .errors import CheckpointError, in_context
from .format import TensorEntry
from .index import Checkpoint, CheckpointPath, open_checkpoint
from .plan import KeyMap, map_names, plan_load
from .progress import LoadReport, Progress, ProgressArg, set_report


def read_tensor(entry: TensorEntry) -> np.ndarray:
    """The tensor's values as a new array in its dtype's compute dtype (bfloat16 and float8
    decoded to float32): one pread straight into the array where NumPy has the dtype."""
    dt = entry.dtype
    try:
        if dt.compute.name == dt.name and dt.name != "bool":
            out = np.empty(entry.shape, dtype=dt.compute)
            _C.pread_into(entry.file.fd, entry.offset, out)
            return out
        raw = np.empty(entry.shape, dtype=np.uint8 if dt.itemsize == 1 else np.uint16)
        _C.pread_into(entry.file.fd, entry.offset, raw)
    except Exception as e:
        raise in_context(e, entry.where) from e
    if dt.name == "bool":
        if raw.size and raw.max() > 1:
            raise CheckpointError(f"{entry.where}: BOOL data holds bytes other than 0 and 1")
        return raw.view(np.bool_)
    return _C.decode(raw, dt.name)


def load_checkpoint(path: CheckpointPath, key_map: KeyMap | None = None, *, strict: bool = True) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint, whole: name -> array (bfloat16/float8 as float32 values).

    ``key_map`` renames (and, returning None, drops) tensors as in :func:`load_model_sharded`;
    ``strict=False`` accepts gaps and trailing bytes in the data section (see docs/checkpoints.md).
    """
    with open_checkpoint(path, strict=strict) as ckpt:
        return {name: read_tensor(e) for name, e in map_names(ckpt, key_map).items()}


def load_model_whole(
    model: Any,
    checkpoint: CheckpointPath | Checkpoint,
    *,
    key_map: KeyMap | None = None,
    progress: ProgressArg = True,
    strict: bool = True,
) -> Any:
    """Load every parameter whole (the strategy streaming is compared with): every rank holds
    the full model afterwards; shard it with ``hsdp.apply_hsdp_to_model``. Returns the model.

    All tensors are read before any parameter is assigned, so a failure leaves the model as
    it was.
    """
    own = not isinstance(checkpoint, Checkpoint)
    ckpt = open_checkpoint(checkpoint, strict=strict) if own else checkpoint
    try:
        plan = plan_load(model, ckpt, key_map)
        total = plan.nbytes(it.param for it in plan.items)
        prog = Progress(ckpt.path, len(plan.items), total, progress, unit="tensors")
        t0 = time.perf_counter()
        values = []
        for it in plan.items:
            values.append(read_tensor(it.entry))
            prog.advance(it.entry.nbytes)
        ad = adapter_for(model)
        for it, v in zip(plan.items, values):
            ad.assign(it.param, v)
        prog.finish()
        seconds = time.perf_counter() - t0
        set_report(model, LoadReport(ckpt.path, "whole", len(plan.items), prog.bytes_read, prog.bytes_read, seconds))
    finally:
        if own:
            ckpt.close()
    return model


__all__ = ["read_tensor", "load_checkpoint", "load_model_whole"]
