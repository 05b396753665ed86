"""Bytes from one rank to every rank of a group: its length, then its bytes, as two broadcasts.
The one way hsdp's commands hand a message around (hsdp serve's job messages and outcome
agreement, hsdp.Omni's calls, the hub's resolved snapshot)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["broadcast_bytes"]


def broadcast_bytes(group: Any, data: bytes | None, root: int = 0) -> bytes:
    """``data`` on ``root`` (ignored elsewhere: pass None), on every rank of ``group``."""
    mine = group.rank == root
    payload = (data or b"") if mine else b""
    size = np.array([len(payload)], dtype=np.int64)
    group.broadcast(size, root)
    buf = np.frombuffer(payload, dtype=np.uint8).copy() if mine else np.empty(int(size[0]), dtype=np.uint8)
    if buf.size:
        group.broadcast(buf, root)
    return buf.tobytes()
