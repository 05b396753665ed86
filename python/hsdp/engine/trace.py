"""Traces: one Chrome-trace JSON file per rank with, per unit, the gather on the collective
worker thread, the time the Python thread waited for it, and the unit's compute. Open the
files in Perfetto (ui.perfetto.dev) or chrome://tracing: gathers that hide behind compute
show as worker spans under compute spans with no wait between them.

Turned on by the environment variable ``HSDP_TRACE=DIR`` or by :func:`enable`. When it is
off the hooks check one module-level boolean and nothing else. This module only records
what the hooks did; it never gathers or reshards anything itself.
"""

from __future__ import annotations

import atexit
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import _C

if TYPE_CHECKING:
    from .schedule import Schedule
    from .units import UnitState

enabled = False
_dir: Path | None = None
_events: list[dict[str, Any]] = []
_open: dict[int, int] = {}  # id(unit) -> compute start (ns)
_registered = False
_rank_seen: int | None = None  # kept from the first event: at exit the group may be gone
_PY, _WORKER = 0, 1


def _rank() -> int:
    global _rank_seen
    if _rank_seen is None:
        from ..world import distributed

        if not distributed.is_initialized():
            return 0
        _rank_seen = distributed.get_rank()
    return _rank_seen


def enable(directory: str | os.PathLike[str]) -> None:
    """Start recording; the trace is written to DIR/hsdp-trace-rank<r>.json by :func:`write`
    (called at exit)."""
    global enabled, _dir, _registered
    _dir = Path(directory)
    _dir.mkdir(parents=True, exist_ok=True)
    enabled = True
    if not _registered:
        atexit.register(write)
        _registered = True


def disable() -> None:
    global enabled
    enabled = False


def _span(name: str, tid: int, start_ns: int, end_ns: int, **args: Any) -> None:
    _events.append({"name": name, "ph": "X", "pid": _rank(), "tid": tid, "ts": start_ns / 1e3,
                    "dur": max(end_ns - start_ns, 0) / 1e3, "args": args})


def record_unshard(st: UnitState, t0: int, t1: int, prefetched: bool) -> None:
    """Records an unshard the hook did between t0 and t1 (waiting for a prefetch when one was
    in flight) and the gather's own span on the worker. Records only: it acts on nothing."""
    submit, start, end = st.unit.gather_times()
    _span(f"wait {st.label}", _PY, t0, t1, prefetched=prefetched)
    _span(f"gather {st.label}", _WORKER, start, end, bytes=st.unit.total_bytes,
          queued_us=(start - submit) / 1e3, prefetched=prefetched)


def prefetch_started(st: UnitState) -> None:
    _events.append({"name": f"prefetch {st.label}", "ph": "i", "s": "t", "pid": _rank(), "tid": _PY,
                    "ts": _C.now_ns() / 1e3})


def forward_done(sched: Schedule) -> None:
    """A counter per forward: the unit gathers it started and the bytes they moved, and the
    bytes kept resident (a residency budget)."""
    rep = sched.report()
    _events.append({"name": "hsdp forward", "ph": "C", "pid": _rank(), "tid": _PY, "ts": _C.now_ns() / 1e3,
                    "args": {"gathers": sched.last_gathers, "resident_bytes": rep["resident_bytes"]}})


def resident_chosen(sched: Schedule) -> None:
    """The units a residency budget keeps gathered, with the rule and the sizes."""
    _events.append({"name": "hsdp residency", "ph": "i", "s": "p", "pid": _rank(), "tid": _PY,
                    "ts": _C.now_ns() / 1e3, "args": sched.report()})


def compute_begin(st: UnitState) -> None:
    _open[id(st)] = _C.now_ns()


def compute_end(st: UnitState) -> None:
    t0 = _open.pop(id(st), None)
    if t0 is not None:
        _span(f"compute {st.label}", _PY, t0, _C.now_ns())


def events() -> list[dict[str, Any]]:
    """The events recorded so far (a copy)."""
    return list(_events)


def write(path: str | os.PathLike[str] | None = None) -> Path | None:
    """Writes the trace (to DIR/hsdp-trace-rank<r>.json unless `path` is given) and clears
    the recorded events. Returns the path, or None when nothing was recorded."""
    if not _events:
        return None
    rank = _rank()
    if path is None:
        if _dir is None:
            return None
        path = _dir / f"hsdp-trace-rank{rank}.json"
    meta = [
        {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
        {"name": "thread_name", "ph": "M", "pid": rank, "tid": _PY, "args": {"name": "python (compute)"}},
        {"name": "thread_name", "ph": "M", "pid": rank, "tid": _WORKER, "args": {"name": "collective worker"}},
    ]
    out = Path(path)
    out.write_text(json.dumps({"traceEvents": meta + _events, "displayTimeUnit": "ms"}))
    _events.clear()
    return out


if os.environ.get("HSDP_TRACE"):
    enable(os.environ["HSDP_TRACE"])
