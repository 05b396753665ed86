"""Prefetch settings, weight residency, the buffer pool and traces, in one process (the
multi-rank prefetch checks are scenarios in tests/mpi_worker.py)."""

from __future__ import annotations

import dataclasses
import gc
import json

import numpy as np
import pytest

import hsdp
from hsdp import models
from hsdp.world.distributed import init_process_group

init_process_group("single")
TINY = models.DiTConfig.preset("tiny")


def sharded(**kw):
    model = models.make_model("tiny", seed=0)
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, **kw))
    return model


@pytest.fixture(autouse=True)
def _clean():
    yield
    gc.collect()
    hsdp.empty_pool()


def test_prefetch_settings_validate():
    c = hsdp.HSDPInferenceConfig(prefetch_depth=3, max_unsharded_bytes=1 << 20)
    assert (c.prefetch_depth, c.max_unsharded_bytes) == (3, 1 << 20)
    with pytest.raises(ValueError, match="prefetch_depth must be >= 0, got -1"):
        hsdp.HSDPInferenceConfig(prefetch_depth=-1)
    with pytest.raises(ValueError, match="max_unsharded_bytes must be positive or None, got 0"):
        hsdp.HSDPInferenceConfig(max_unsharded_bytes=0)
    with pytest.raises(TypeError, match="max_unsharded_bytes"):
        hsdp.HSDPInferenceConfig(max_unsharded_bytes="1GB")
    with pytest.raises(TypeError):
        hsdp.HSDPInferenceConfig(True, 1, -1, "bf16", "fp32", None, True, 2)  # keyword-only


def test_schedule_records_then_prefetches():
    model = sharded(prefetch_depth=1)
    sched = model._hsdp_context.schedule
    x = models.make_inputs(TINY, seed=0)
    out = model(*x)
    assert not sched.recording
    assert [u.fqn for u in sched.order] == ["", *[f"blocks.{i}" for i in range(TINY.num_layers)]]
    before = sched.prefetches
    assert np.array_equal(model(*x), out)
    assert sched.prefetches - before == TINY.num_layers  # each block gathered ahead of its turn
    off = sharded(prefetch_depth=0)
    assert np.array_equal(off(*x), out) and np.array_equal(off(*x), out)
    assert off._hsdp_context.schedule.prefetches == 0


def test_no_allocation_after_first_forward():
    model = sharded(prefetch_depth=2)
    x = models.make_inputs(TINY, seed=0)
    model(*x)
    allocs = hsdp.memory_stats()["buffer_allocs"]
    for _ in range(3):
        model(*x)
    stats = hsdp.memory_stats()
    assert stats["buffer_allocs"] == allocs
    assert stats["unsharded_bytes"] == 0 and stats["pooled_bytes"] > 0
    assert stats["held_bytes"] == stats["sharded_bytes"] + stats["pooled_bytes"] + stats["whole_bytes"]
    hsdp.empty_pool()
    assert hsdp.memory_stats()["pooled_bytes"] == 0


def test_view_kept_by_user_is_never_reused():
    """A buffer a user still views is not pooled: its numbers can never change under them."""
    model = sharded()
    x = models.make_inputs(TINY, seed=0)
    model(*x)
    hsdp.unshard(model.blocks[0])
    kept = model.blocks[0].ffn[0].weight.data
    snapshot = kept.copy()
    hsdp.reshard(model.blocks[0])
    for _ in range(2):
        model(*x)
    assert np.array_equal(kept, snapshot)


def test_resident_keeps_weights_and_reshards_on_exit():
    model = sharded()
    x = models.make_inputs(TINY, seed=0)
    expect = model(*x)
    with hsdp.resident(model) as m:
        assert m is model
        assert all(u.unit.is_unsharded for u in hsdp.get_units(model))
        gathers = hsdp.memory_stats()["gathers"]
        for _ in range(3):
            assert np.array_equal(model(*x), expect)
        assert hsdp.memory_stats()["gathers"] == gathers  # no gather per step
    assert not any(u.unit.holds_buffers for u in hsdp.get_units(model))
    assert hsdp.memory_stats()["unsharded_bytes"] == 0


def test_resident_reshards_after_exception():
    model = sharded()
    with pytest.raises(KeyError, match="boom"):
        with hsdp.resident(model):
            assert all(u.unit.is_unsharded for u in hsdp.get_units(model))
            raise KeyError("boom")
    assert not any(u.unit.holds_buffers for u in hsdp.get_units(model))
    with pytest.raises(RuntimeError, match="sharded"):
        model.blocks[0].ffn[0].weight.data


def test_trace_records_gather_wait_and_compute(tmp_path):
    model = sharded()
    x = models.make_inputs(TINY, seed=0)
    hsdp.trace.enable(tmp_path)
    try:
        model(*x)
        model(*x)
        path = hsdp.trace.write()
    finally:
        hsdp.trace.disable()
    assert path == tmp_path / "hsdp-trace-rank0.json"
    doc = json.loads(path.read_text())
    names = [e["name"] for e in doc["traceEvents"]]
    for label in ["<root>", *[f"blocks.{i}" for i in range(TINY.num_layers)]]:
        assert names.count(f"compute {label}") == 2, label
        assert names.count(f"gather {label}") == 2, label
        assert names.count(f"wait {label}") == 2, label
    assert any(n.startswith("prefetch blocks.") for n in names)
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["tid"] in (0, 1) for e in spans)
    assert {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"} >= {"collective worker"}
    assert hsdp.trace.write() is None  # events were cleared


# --------------------------------------------------------------------------- review regressions


def _steady_allocs(model, x, forwards: int = 3) -> int:
    model(*x)
    before = hsdp.memory_stats()["buffer_allocs"]
    for _ in range(forwards):
        model(*x)
    return hsdp.memory_stats()["buffer_allocs"] - before


def test_units_kept_unsharded_get_no_second_pooled_copy():
    model = sharded(reshard_after_forward=False)
    x = models.make_inputs(TINY, seed=0)
    assert _steady_allocs(model, x) == 0
    stats = hsdp.memory_stats()
    assert stats["pooled_bytes"] == 0
    assert stats["unsharded_bytes"] == sum(u.full_bytes for u in hsdp.get_units(model))


def test_first_forward_inside_resident_reserves_no_duplicate():
    model = sharded()
    x = models.make_inputs(TINY, seed=0)
    with hsdp.resident(model):
        model(*x)  # the recording forward, with every unit held
        assert hsdp.memory_stats()["pooled_bytes"] == 0
    assert _steady_allocs(model, x) == 0  # released buffers filled the pool


def test_byte_cap_is_respected_and_steady():
    probe = sharded()
    units = hsdp.get_units(probe)
    cap = units[0].full_bytes * 2 + units[-1].full_bytes  # root + the block computing + one more
    del probe, units
    gc.collect()
    model = sharded(prefetch_depth=3, max_unsharded_bytes=cap)
    x = models.make_inputs(TINY, seed=0)
    model(*x)
    hsdp._C.reset_peak()
    assert _steady_allocs(model, x) == 0
    assert 0 < hsdp.memory_stats()["peak_unsharded_bytes"] <= cap
    assert model._hsdp_context.schedule.prefetches > 0


def test_two_models_share_the_pool_without_allocating():
    a, b = sharded(), sharded(prefetch_depth=2)
    x = models.make_inputs(TINY, seed=0)
    a(*x)
    b(*x)
    a(*x)
    b(*x)
    before = hsdp.memory_stats()["buffer_allocs"]
    for _ in range(3):
        a(*x)
        b(*x)
    assert hsdp.memory_stats()["buffer_allocs"] == before


def test_empty_root_unit_allocates_nothing():
    from hsdp import nn

    class Blocks(nn.Module):
        _hsdp_shard_conditions = [lambda name, m: name.startswith("layers.") and name.count(".") == 1]

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    model = Blocks()
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True))
    assert hsdp.get_units(model)[-1].unit.total_bytes == 0
    x = (np.ones((1, 4), np.float32),)
    assert _steady_allocs(model, x, 5) == 0


def test_oversized_pool_need_warns_instead_of_failing(caplog):
    model = sharded(prefetch_depth=300, reshard_after_forward=True)
    sched = model._hsdp_context.schedule
    from hsdp.engine import schedule

    saved = schedule._POOL_SLOTS
    schedule._POOL_SLOTS = 2  # a model needing more buffers than the pool keeps
    try:
        x = models.make_inputs(TINY, seed=0)
        with caplog.at_level("WARNING", logger="hsdp"):
            out = model(*x)  # the recording forward must still return its output
        assert "the pool keeps 2" in caplog.text
        assert np.array_equal(model(*x), out) and not sched.recording
    finally:
        schedule._POOL_SLOTS = saved


def test_core_errors_name_the_value():
    with pytest.raises(ValueError, match="unknown backend 'bogus'"):
        hsdp._C.ProcessGroup(backend="bogus")
    group = hsdp.init_device_mesh("cpu", (1, 1)).shard_group
    with pytest.raises(ValueError, match="too large"):
        hsdp._C.Unit(group, ["uint8"] * 3, [(2**63 - 64,), (2**63 - 64,), (192,)])


# --------------------------------------------------------------------------- residency budget

SIX = dataclasses.replace(TINY, num_layers=6)


def _six(**kw):
    model = models.make_model(SIX, seed=0)
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, **kw))
    return model


def _gathers_of(model, x) -> tuple[np.ndarray, int]:
    before = hsdp.memory_stats()["gathers"]
    out = model(*x)
    return out, hsdp.memory_stats()["gathers"] - before


def test_residency_budget_of_half_the_blocks():
    """Outputs equal the budget-free run bit for bit; after the first forward the budget's
    units stay gathered (unsharded_bytes within [0.3, 1.0] x the budget) and the gathers per
    forward drop by the units kept."""
    x = models.make_inputs(SIX, seed=0)
    free = _six()
    expect = [free(*x) for _ in range(3)]
    units = hsdp.get_units(free)
    budget = sum(u.full_bytes for u in units if not u.is_root) // 2
    del free, units
    gc.collect()
    model = _six(resident_bytes=budget)
    out, first = _gathers_of(model, x)  # records the order, then chooses
    assert np.array_equal(out, expect[0]) and first == SIX.num_layers + 1
    stats = hsdp.residency_stats(model)
    kept = stats["resident_units"]
    # the exposed units (the root, then the first block), then the equal blocks in forward order
    assert kept == ["<root>", *[f"blocks.{i}" for i in range(len(kept) - 1)]] and 2 <= len(kept) < SIX.num_layers
    assert stats["budget_bytes"] == budget and 0 < stats["resident_bytes"] <= budget
    assert hsdp.memory_stats()["resident_units"] == kept
    out, second = _gathers_of(model, x)  # the kept units gather once more, then stay
    assert np.array_equal(out, expect[1]) and second == SIX.num_layers + 1
    allocs = hsdp.memory_stats()["buffer_allocs"]
    for i in range(2):
        out, steady = _gathers_of(model, x)
        assert np.array_equal(out, expect[2]) and steady == SIX.num_layers + 1 - len(kept)
        unsharded = hsdp.memory_stats()["unsharded_bytes"]
        assert 0.3 * budget <= unsharded <= budget, (unsharded, budget)
    assert hsdp.memory_stats()["buffer_allocs"] == allocs  # the steady state allocates nothing
    stats = hsdp.residency_stats(model)
    assert stats["gathers_per_forward"] == stats["last_forward_gathers"] == steady
    assert stats["bytes_per_gather"] * steady <= stats["gathered_bytes_per_forward"]
    assert model._hsdp_context.schedule.prefetches > 0  # prefetch goes on past the kept units
    hsdp.reshard(model, recurse=True)  # frees the kept units; the next forward keeps them again
    assert hsdp.memory_stats()["unsharded_bytes"] == 0
    assert np.array_equal(model(*x), expect[0]) and hsdp.memory_stats()["unsharded_bytes"] > 0


def test_residency_budget_ends_zero_and_whole_model():
    x = models.make_inputs(SIX, seed=0)
    none = _six(resident_bytes=0)
    expect = none(*x)
    out, n = _gathers_of(none, x)
    assert np.array_equal(out, expect) and n == SIX.num_layers + 1
    assert hsdp.residency_stats(none)["resident_units"] == []
    del none
    gc.collect()
    whole = _six(resident_bytes=1 << 40)
    whole(*x)
    whole(*x)
    out, n = _gathers_of(whole, x)
    assert np.array_equal(out, expect) and n == 0
    assert hsdp.residency_stats(whole)["resident_units"][0] == "<root>"
    assert hsdp.memory_stats()["unsharded_bytes"] == sum(u.full_bytes for u in hsdp.get_units(whole))


def test_residency_auto_is_positive_and_below_mem_available():
    from hsdp.engine import residency

    model = sharded(resident_bytes="auto")
    model(*models.make_inputs(TINY, seed=0))
    got = hsdp.residency_stats(model)["budget_bytes"]
    assert 0 < got < residency.mem_available()


def test_residency_auto_margin_and_ranks_per_host(monkeypatch):
    from hsdp.engine import residency

    gib = 1 << 30
    for avail, ranks, want in [(10 * gib, "1", 8 * gib), (20 * gib, "2", 8 * gib), (2 * gib, "1", gib),
                               (gib // 2, "1", 0)]:
        monkeypatch.setattr(residency, "mem_available", lambda avail=avail: avail)
        monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", ranks)
        assert residency.auto_budget("host") == want, (avail, ranks)


def test_residency_rule_prefers_exposed_then_small_units():
    from hsdp.engine.residency import choose

    class U:
        def __init__(self, name: str, n: int) -> None:
            self.label, self.full_bytes = name, n

    root, a, b, c, d = U("root", 50), U("a", 40), U("b", 30), U("c", 10), U("d", 30)
    order = [root, a, b, c, d, a]  # a unit called twice counts once
    assert [u.label for u in choose(order, 90, depth=1)] == ["root", "a"]
    assert [u.label for u in choose(order, 100, depth=1)] == ["root", "a", "c"]
    assert [u.label for u in choose(order, 45, depth=1)] == ["a"]  # the root does not fit
    # without prefetch every gather is exposed: smallest first, ties in forward order
    assert [u.label for u in choose(order, 70, depth=0)] == ["c", "b", "d"]
    assert choose(order, 0, depth=1) == []


def test_residency_budget_validates():
    for bad, err in [(-1, ValueError), (1.5, TypeError), (True, TypeError), ("lots", TypeError)]:
        with pytest.raises(err, match="resident_bytes"):
            hsdp.HSDPInferenceConfig(resident_bytes=bad)
    c = hsdp.HSDPInferenceConfig(resident_bytes="auto")
    assert c.resident_bytes == "auto" and "resident_bytes='auto'" in repr(c)
    c.resident_bytes = 1 << 20
    assert c == hsdp.HSDPInferenceConfig(resident_bytes=1 << 20) != hsdp.HSDPInferenceConfig()


def test_residency_shows_in_the_trace(tmp_path):
    model = sharded(resident_bytes=1 << 40)
    x = models.make_inputs(TINY, seed=0)
    hsdp.trace.enable(tmp_path)
    try:
        for _ in range(3):
            model(*x)
        events = hsdp.trace.events()
        hsdp.trace.write()
    finally:
        hsdp.trace.disable()
    chosen = [e for e in events if e["name"] == "hsdp residency"]
    assert len(chosen) == 1 and chosen[0]["args"]["resident_units"] == ["<root>", "blocks.0", "blocks.1"]
    per_forward = [e["args"]["gathers"] for e in events if e["name"] == "hsdp forward"]
    assert per_forward == [TINY.num_layers + 1, TINY.num_layers + 1, 0]
    assert all(e["args"]["bytes"] > 0 for e in events if e["name"].startswith("gather "))


def test_residency_auto_that_cannot_read_memory_refuses_every_forward(monkeypatch):
    from hsdp.engine import residency

    def unreadable() -> int:
        raise RuntimeError("/proc/meminfo has no MemAvailable line")

    monkeypatch.setattr(residency, "mem_available", unreadable)
    model = sharded(resident_bytes="auto")
    x = models.make_inputs(TINY, seed=0)
    with pytest.raises(RuntimeError, match="MemAvailable"):
        model(*x)
    with pytest.raises(RuntimeError, match="hsdp residency budget: .*MemAvailable"):
        model(*x)
    assert not any(u.unit.holds_buffers for u in hsdp.get_units(model))
