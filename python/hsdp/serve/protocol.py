"""Messages from rank 0 to every rank: a JSON object broadcast over the world group (its length,
then its bytes), and the agreement on a job's outcome after it ran."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from hsdp.world.messages import broadcast_bytes

__all__ = ["agree_outcome", "recv_message", "send_message"]


def send_message(group: Any, message: dict[str, Any]) -> None:
    """Rank 0: broadcast ``message`` (JSON-serialisable) to every rank of ``group``."""
    broadcast_bytes(group, json.dumps(message, separators=(",", ":")).encode("utf-8"))


def recv_message(group: Any) -> dict[str, Any]:
    """Ranks other than 0: the next message rank 0 sends."""
    message = json.loads(broadcast_bytes(group, None).decode("utf-8"))
    if not isinstance(message, dict) or "op" not in message:
        raise RuntimeError(f"hsdp serve: rank 0 sent a message this rank cannot read: {message!r:.200}")
    return message


def agree_outcome(group: Any, error: str | None) -> str | None:
    """Every rank's verdict on the job it just ran: None when every rank succeeded, else the
    error of the lowest failing rank (the same string on every rank), so that rank 0 marks the
    job failed even when only another rank saw the failure."""
    flags = np.empty(group.size, dtype=np.int64)
    group.all_gather(np.array([0 if error is None else 1], dtype=np.int64), flags)
    failing = [r for r in range(group.size) if flags[r]]
    if not failing:
        return None
    root = failing[0]
    text = broadcast_bytes(group, (error or "").encode("utf-8")[:4000], root).decode("utf-8", errors="replace")
    return text if root == 0 else f"rank {root}: {text}"
