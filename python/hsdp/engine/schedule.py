"""Prefetch: the order units run in, recorded on the first forward, and the gathers started
ahead of it on every later forward.

Why every rank of a shard group issues the same gathers in the same order: a rank's
gathers are started only from forward hooks, in the order its forward calls them, and the
decision to prefetch depends only on the recorded order, the position in it and the sizes
of units (never on timing or on measured memory). Ranks that run the same forward (the same
module calls in the same order, which sharded inference requires anyway) therefore make the
same decisions, and the collective worker keeps each rank's gathers in program order.

A forward that departs from the recorded order (a block skipped on some calls, say) is
detected at the first unit that differs: the prefetched but unused units are released, and
the forward goes on with an order recorded before that agrees with it so far (the schedule
remembers the last few, so a forward alternating between patterns settles on them), or else
the order is recorded again from that point. The choice depends only on the units entered
and the orders recorded, which are the same on every rank. Nothing waits on a gather that
another rank will not issue, so a departure can cost overlap, never a deadlock.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from .. import _C
from . import residency, trace

if TYPE_CHECKING:
    from .lockstep import Lockstep
    from .units import UnitState


log = logging.getLogger("hsdp")

# Every live schedule's steady-state need, per buffer size. Models take turns on one thread,
# so the pool must cover, size by size, the largest need of any of them.
_needs: "weakref.WeakKeyDictionary[Schedule, Counter[int]]" = weakref.WeakKeyDictionary()
_POOL_SLOTS: int = _C.POOL_SLOTS  # the C pool's capacity, read from the core
_KNOWN_ORDERS = 4  # recorded orders a schedule remembers, most recently used first
# Schedules with a residency budget, for memory_stats()'s resident_units.
_budgeted: "weakref.WeakSet[Schedule]" = weakref.WeakSet()


class _Recorded(NamedTuple):
    """One recorded forward: its unit order, its hook events and its pool need per size."""

    order: tuple[UnitState, ...]
    events: tuple[tuple[bool, UnitState], ...]
    peak: Counter[int]


def _same(a: Sequence[UnitState], b: Sequence[UnitState]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _stream_probe(group: _C.ProcessGroup | None) -> Callable[[], int] | None:
    if group is None or group.backend != "nccl":
        return None
    from ..world import nccl

    return nccl.stream_probe()


class Schedule:
    """One sharded model's unit order and prefetch state."""

    def __init__(self, depth: int, max_bytes: int | None, resident_budget: int | str | None = None,
                 group: _C.ProcessGroup | None = None) -> None:
        self.depth = depth
        self.max_bytes = max_bytes
        # The residency budget as configured (bytes, "auto" or None), the bytes it resolved
        # to (agreed over `group` at the end of the first forward), and the units it keeps.
        self.resident_budget = resident_budget
        self.budget_bytes: int | None = None
        self.resident: list[UnitState] = []
        self._flipped: set[int] = set()             # ids of units the budget stopped resharding
        self._group = group
        self._budget_error: str | None = None
        self._gathers_at_begin = 0
        self.last_gathers = 0                       # unit gathers the last forward started
        if resident_budget is not None:
            _budgeted.add(self)
        # Over NCCL onto the GPU: torch's current stream, read at each forward's start
        # (world/nccl.py, stream_probe), so a forward run under `torch.cuda.stream(s)` has its
        # gathers ordered before `s` and its buffers released after it. None elsewhere.
        self._stream_now = _stream_probe(group)
        # Data parallel (lockstep.py): the ballot of the lanes sharing this model's shard group,
        # and this model's vote; None without data parallelism.
        self.lockstep: Lockstep | None = None
        self.lockstep_id = -1
        self.units: list[UnitState] = []  # every unit of the model, as registered (serve's fallback order)
        self.order: list[UnitState] = []            # units by pre-forward, frozen once recorded
        self.events: list[tuple[bool, UnitState]] = []  # (is_pre, unit) of the recording forward
        self.recording = True
        self.in_forward = False
        self.pos = 0                                # next expected index in `order`
        self.prefetched: list[UnitState] = []       # started by us, not yet entered
        self.known: list[_Recorded] = []            # recorded orders, most recently used first
        self.rerecords = 0
        self.switches = 0                           # departures that went on with a known order
        self.forwards = 0
        self.prefetches = 0                         # gathers started ahead, for tests and benches

    # ---------------------------------------------------------------- forward boundaries

    def begin(self) -> None:
        """The root's pre-forward: a new forward starts."""
        if self._budget_error is not None:
            raise RuntimeError(self._budget_error)
        if self.lockstep is not None:  # data parallel: the other lanes' models first, served
            self.lockstep.enter(self)
        if self._stream_now is not None:
            _C.nccl_set_stream(self._stream_now())
        self._gathers_at_begin = _C.memory_stats()["gathers"]
        self.in_forward = True
        self.pos = 0
        if self.recording:
            self.order = []
            self.events = []

    def end(self) -> None:
        """The root's post-forward (also after an exception)."""
        self.in_forward = False
        self.forwards += 1
        if self.recording:
            self.recording = False
            if self.resident_budget is not None:
                self._apply_budget()
            self._reserve_pool()
        elif self.pos != len(self.order):
            # This forward ran fewer units than recorded: switch to a known order that ends
            # here, or record again next time.
            self._release_prefetched()
            if not self._switch(self.pos, None):
                self._rerecord_from(self.pos)
        self._release_prefetched()
        self.last_gathers = _C.memory_stats()["gathers"] - self._gathers_at_begin
        # NCCL compares the agreement tickets of started gathers late (docs/design.md, "Tickets
        # checked late"): a forward whose units the ranks disagreed on raises here on every
        # rank instead of returning. Nothing to do on other backends.
        _C.nccl_agreement_drain()
        if trace.enabled:
            trace.forward_done(self)

    def serve(self) -> int:
        """Joins the gathers of one forward of this model that other ranks of the shard group
        compute, computing nothing ([Note: lockstep]): every unit in the order they gather
        them, gathered and given back at once. Units gathered without peers (direct, after
        their first) or kept gathered are passed over. Returns the gathers joined."""
        if self.in_forward:
            raise RuntimeError("lockstep: a model cannot serve its own forward while it runs")
        if self.order and not self.recording:
            order = self.order
        else:  # never run here: the root's pre-forward comes first, then the units as registered
            order = [u for u in self.units if u.is_root] + [u for u in self.units if not u.is_root]
        joined = 0
        for u in order:
            unit = u.unit
            if unit.holds_buffers or unit.gather_path == "direct":
                continue
            unit.unshard()
            unit.reshard()
            joined += 1
        _C.nccl_agreement_drain()  # as a computed forward ends (NCCL compares its tickets late)
        return joined

    # ---------------------------------------------------------------- residency

    def _apply_budget(self) -> None:
        """Resolves the budget once (a collective over the shard group: every rank runs it at
        the end of its first forward) and keeps the units the rule chooses gathered from the
        next forward on; units a re-recorded order no longer chooses reshard now."""
        if self.budget_bytes is None:
            try:
                auto = self.resident_budget == "auto"
                failed: Exception | None = None
                if auto:
                    try:
                        mine = residency.auto_budget(self.order[0].unit.device if self.order else "host")
                    except Exception as exc:  # still joins the exchange, so every rank learns of it
                        failed, mine = exc, -1
                else:
                    mine = int(self.resident_budget)  # type: ignore[arg-type]
                try:
                    agreed = residency.agree(self._group, mine, auto)
                except Exception:
                    if failed is not None:
                        raise failed from None  # this rank's own reason; the others name this rank
                    raise
                if failed is not None:
                    raise failed
                self.budget_bytes = agreed
            except Exception as exc:
                # every later forward refuses too: a rank must not go on skipping gathers alone
                self._budget_error = f"hsdp residency budget: {exc}"
                raise
            if auto:
                log.info("resident_bytes='auto' resolved to %d bytes per rank (free memory less %d%%, at "
                         "least %d bytes; the smallest over the shard group)", self.budget_bytes,
                         round(residency.AUTO_MARGIN * 100), residency.AUTO_MIN_MARGIN)
        chosen = residency.choose(self.order, self.budget_bytes, self.depth)
        ids = {id(u) for u in chosen}
        for u in self.resident:
            if id(u) not in ids and id(u) in self._flipped:  # dropped by a new order: back to resharding
                u.reshard_after_forward = True
                self._flipped.discard(id(u))
                u.release_prefetch()
        for u in chosen:
            if u.reshard_after_forward:  # units the config keeps unsharded stay as they are
                u.reshard_after_forward = False
                self._flipped.add(id(u))
        self.resident = chosen
        log.info("residency budget %d bytes keeps %d of %d units gathered (%d bytes): %s; rule: %s",
                 self.budget_bytes, len(chosen), len({id(u) for u in self.order}), self.resident_bytes,
                 ", ".join(u.label for u in chosen) or "none", residency.RULE)
        if trace.enabled:
            trace.resident_chosen(self)

    @property
    def resident_bytes(self) -> int:
        return sum(u.full_bytes for u in self.resident)

    def report(self) -> dict[str, object]:
        """What the budget chose and what a forward gathers (see hsdp.residency_stats)."""
        units = list({id(u): u for u in self.order}.values())
        kept = {id(u) for u in units if not u.reshard_after_forward}
        gathered = [u for u in units if id(u) not in kept]
        gathered_bytes = sum(u.unit.total_bytes for u in gathered)
        return {
            "budget": self.resident_budget,
            "budget_bytes": self.budget_bytes,
            "rule": residency.RULE,
            "resident_units": [u.label for u in self.resident],
            "resident_bytes": self.resident_bytes,
            "units": len(units),
            "gathers_per_forward": len(gathered),
            "gathered_bytes_per_forward": gathered_bytes,
            "bytes_per_gather": gathered_bytes // len(gathered) if gathered else 0,
            "last_forward_gathers": self.last_gathers,
        }

    # ---------------------------------------------------------------- per unit

    def enter(self, unit: UnitState) -> None:
        """A unit's pre-forward, before it unshards (prefetching comes after: see prefetch)."""
        if self.recording:
            self.order.append(unit)
            self.events.append((True, unit))
            return
        if self.pos < len(self.order) and self.order[self.pos] is unit:
            self.pos += 1
            if unit in self.prefetched:
                self.prefetched.remove(unit)
            return
        # Departure from the recorded order.
        self._release_prefetched(keep=unit)
        if self._switch(self.pos, unit):
            if unit in self.prefetched:
                self.prefetched.remove(unit)
            self.pos += 1
            return
        self._rerecord_from(self.pos)
        self.order.append(unit)
        self.events.append((True, unit))
        self.pos += 1

    def leave(self, unit: UnitState) -> None:
        if self.recording:
            self.events.append((False, unit))

    # ---------------------------------------------------------------- internals

    def _switch(self, pos: int, unit: UnitState | None) -> bool:
        """A departure at ``pos``, with ``unit`` entering there (None: the forward ended):
        goes on with a known order that agrees with this forward so far, if there is one."""
        prefix = self.order[:pos]
        for k, rec in enumerate(self.known):
            nxt = rec.order[pos] if pos < len(rec.order) else None
            if nxt is unit and _same(rec.order[:pos], prefix):
                self.known.insert(0, self.known.pop(k))
                self.order = list(rec.order)
                self.events = list(rec.events)
                self.switches += 1
                return True
        return False

    def _rerecord_from(self, pos: int) -> None:
        self.rerecords += 1
        self.recording = True
        kept = set(map(id, self.order[:pos]))
        self.order = self.order[:pos]
        # Keep the events of the kept prefix so the pool sizing sees the whole forward.
        cut = 0
        seen = 0
        for i, (is_pre, u) in enumerate(self.events):
            if is_pre:
                if seen == pos:
                    break
                seen += 1
            cut = i + 1
        self.events = [e for e in self.events[:cut] if id(e[1]) in kept]

    def _held_bytes(self) -> int:
        return sum(u.full_bytes for u in self.order if u.unit.holds_buffers)

    def prefetch(self) -> None:
        """Called once the entered unit holds its buffers: starts the next units' gathers, so
        the byte cap counts the unit computing and its own gather never waits behind them."""
        if self.recording or self.depth <= 0:
            return
        cap = self.max_bytes
        held = self._held_bytes() if cap is not None else 0
        for nxt in self._window(self.pos):
            if nxt.unit.holds_buffers or nxt.broken is not None:
                continue
            if cap is not None:
                if held + nxt.full_bytes > cap:
                    break
                held += nxt.full_bytes
            if nxt.unit.start_unshard():
                self.prefetches += 1
                self.prefetched.append(nxt)
                if trace.enabled:
                    trace.prefetch_started(nxt)

    def _window(self, pos: int) -> list[UnitState]:
        """The next `depth` units from `pos` that gather every forward: units kept gathered
        (a residency budget) are looked past, so the gathers after them start earlier and
        hide behind their compute too. Depends only on the order and the flags, the same on
        every rank."""
        if not self.resident:
            return self.order[pos : pos + self.depth]
        out: list[UnitState] = []
        for u in self.order[pos:]:
            if len(out) == self.depth:
                break
            if u.reshard_after_forward or not u.unit.holds_buffers:  # resident, not yet gathered
                out.append(u)
        return out

    def _release_prefetched(self, keep: UnitState | None = None) -> None:
        for u in self.prefetched:
            if u is not keep:
                u.release_prefetch()
        self.prefetched = [keep] if keep is not None and keep in self.prefetched else []

    def _reserve_pool(self) -> None:
        """Simulates a steady-state forward of the recorded events (prefetch included) and
        reserves the buffers it holds at once, per size, so no later forward allocates.

        Units that never reshard keep their buffers from one forward to the next, so they
        need nothing from the pool; buffers units hold right now (inside hsdp.resident, say)
        count towards the reservation, since they return to the pool when released."""
        pre_order = [u for is_pre, u in self.events if is_pre]
        persistent = {id(u) for u in pre_order if not u.reshard_after_forward}
        live: set[int] = set(persistent)
        by_id: dict[int, UnitState] = {id(u): u for u in pre_order}
        peak: Counter[int] = Counter()
        k = 0
        for is_pre, u in self.events:
            if is_pre:
                k += 1
                held = sum(by_id[i].full_bytes for i in live)
                for cand in [u, *self._window_of(pre_order, k)]:
                    if id(cand) in live:
                        continue
                    if cand is not u and self.max_bytes is not None:
                        if held + cand.full_bytes > self.max_bytes:
                            break
                    live.add(id(cand))
                    by_id[id(cand)] = cand
                    held += cand.full_bytes
                now: Counter[int] = Counter()
                for i in live - persistent:
                    for size in by_id[i].buffer_sizes:
                        now[size] += 1
                for size, n in now.items():
                    peak[size] = max(peak[size], n)
            elif u.reshard_after_forward:
                live.discard(id(u))
        rec = _Recorded(tuple(self.order), tuple(self.events), peak)
        self.known = [rec, *(r for r in self.known if not _same(r.order, rec.order))][:_KNOWN_ORDERS]
        need: Counter[int] = Counter()
        for r in self.known:  # any known order may run next: cover each, size by size
            need |= r.peak
        _needs[self] = need
        held: Counter[int] = Counter()
        for u in {id(u): u for u in pre_order}.values():
            if u.unit.holds_buffers and u.reshard_after_forward:
                held.update(u.buffer_sizes)
        reserve_pool(held)


    def _window_of(self, pre_order: list[UnitState], k: int) -> list[UnitState]:
        if not self.resident:
            return pre_order[k : k + self.depth]
        return [u for u in pre_order[k:] if u.reshard_after_forward][: self.depth]


def reserve_pool(held: Counter[int] | None = None) -> None:
    """Sizes the shared pool to the largest need, size by size, of every live schedule;
    ``held`` are buffers units hold now that will come back to the pool. Never raises: a
    forward must not fail over the pool (at worst a later forward allocates)."""
    need: Counter[int] = Counter()
    for peak in list(_needs.values()):
        need |= peak  # per-size maximum
    # host sizes are ints, device ones (size, device): ordered by size alike
    sizes = sorted(need.elements(), key=lambda k: k if isinstance(k, int) else k[0])
    if len(sizes) > _POOL_SLOTS:
        log.warning("a steady-state forward needs %d unsharded buffers, the pool keeps %d; "
                    "later forwards will allocate", len(sizes), _POOL_SLOTS)
        sizes = sizes[:_POOL_SLOTS]
    missing = list((Counter(sizes) - (held or Counter())).elements())
    try:
        _C.pool_reserve(missing, len(sizes))
    except (ValueError, MemoryError) as exc:
        log.warning("could not reserve the buffer pool (%s); later forwards will allocate", exc)
