"""Run-report helpers shared by the ``hsdp`` commands and the offline examples: peak memory,
all-gathering small per-rank numbers, and the plain-text table."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "broadcast_int", "fmt_bytes", "format_table", "gather_ints", "peak_rss_bytes", "reset_peak_rss",
    "write_json",
]


def reset_peak_rss() -> None:
    """Restart the kernel's peak-RSS count (VmHWM) from the current RSS (Linux; a no-op
    elsewhere): writing 5 to /proc/self/clear_refs does exactly that."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM), or -1 where /proc is not available."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except OSError:
        pass
    return -1


def gather_ints(group: Any, values: Sequence[int]) -> np.ndarray:
    """Every rank's ``values`` as a (world size, len(values)) int64 array, on every rank."""
    send = np.asarray(values, dtype=np.int64)
    recv = np.empty(group.size * send.size, dtype=np.int64)
    group.all_gather(send, recv)
    return recv.reshape(group.size, send.size)


def broadcast_int(group: Any, value: int, root: int = 0) -> int:
    buf = np.array([value], dtype=np.int64)
    group.broadcast(buf, root)
    return int(buf[0])


def fmt_bytes(n: int) -> str:
    if n < 0:
        return "n/a"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def format_table(title: str, rows: Sequence[tuple[str, str]]) -> str:
    width = max(len(label) for label, _ in rows)
    body = [f"{label:<{width}}  {value}" for label, value in rows]
    rule = "-" * max(len(line) for line in body + [title])
    return "\n".join([title, rule, *body, rule])


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
