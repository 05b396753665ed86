"""Load progress on rank 0 (the "hsdp" logger at INFO, throttled) and the report a finished
load leaves on the model (``hsdp.checkpoint.load_report(model)``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..world import distributed, job

log = logging.getLogger("hsdp")

@dataclass(frozen=True)
class LoadProgress:
    """Where a load stands; ``bytes_read`` counts every rank's reads for a sharded load."""

    checkpoint: str
    done: int
    total: int
    bytes_read: int
    seconds: float
    unit: str = "units"

    @property
    def mb_per_s(self) -> float:
        return self.bytes_read / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        mb = self.bytes_read / 1e6
        return f"loading: {self.done}/{self.total} {self.unit}, {mb:.1f} MB read, {self.mb_per_s:.1f} MB/s"


@dataclass(frozen=True)
class LoadReport:
    """What a finished load did: bytes this rank read, bytes all ranks read, wall time."""

    checkpoint: str
    strategy: str  # "streaming" or "whole"
    units: int
    bytes_read: int
    bytes_read_total: int
    seconds: float


ProgressArg = bool | Callable[[LoadProgress], None]


def _rank() -> int:
    if distributed.is_initialized():
        return distributed.get_rank()
    rank = job.launcher_rank()  # launched but not initialised (a whole load needs no collective)
    return 0 if rank is None else rank


class Progress:
    """Counts units and bytes; reports on rank 0 only, at most once per ``interval`` seconds
    in the log (a callable gets every step), and always at the end."""

    interval = 1.0

    def __init__(self, checkpoint: str, total: int, total_bytes: int, arg: ProgressArg, unit: str = "units") -> None:
        self.checkpoint = checkpoint
        self.total = total
        self.total_bytes = total_bytes
        self.unit = unit
        self.done = 0
        self.bytes_read = 0
        self._on = bool(arg) and _rank() == 0
        self._callback = arg if callable(arg) else None
        self._t0 = self._last = time.monotonic()
        if self._on and self._callback is None:
            log.info("loading %s: %d %s, %.1f MB of tensors", checkpoint, total, unit, total_bytes / 1e6)

    def _state(self) -> LoadProgress:
        elapsed = time.monotonic() - self._t0
        return LoadProgress(self.checkpoint, self.done, self.total, self.bytes_read, elapsed, self.unit)

    def advance(self, nbytes: int, count: int = 1) -> None:
        self.done += count
        self.bytes_read += nbytes
        if not self._on or count == 0:  # whole parameters: folded into the next unit's line
            return
        if self._callback is not None:
            try:
                self._callback(self._state())
            except Exception as exc:  # noqa: BLE001
                # Progress runs on rank 0 alone: raising here would leave the other ranks
                # waiting in the load's next collective. Report it and stop calling it.
                log.warning("the progress callback raised %s: %s; it is not called again for this load",
                            type(exc).__name__, exc)
                self._callback = None
                self._on = False
            return
        now = time.monotonic()
        if now - self._last >= self.interval and self.done < self.total:
            self._last = now
            log.info(self._state().line())

    def finish(self) -> None:
        if self._on and self._callback is None:
            s = self._state()
            log.info("loaded %s: %s in %.2f s", self.checkpoint, s.line().removeprefix("loading: "), s.seconds)


def set_report(model: Any, report: LoadReport) -> None:
    object.__setattr__(model, "_hsdp_load_report", report)


def load_report(model: Any) -> LoadReport | None:
    """The report of the last load into ``model`` (None if it was never loaded by hsdp)."""
    return getattr(model, "_hsdp_load_report", None)
