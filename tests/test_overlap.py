"""Prefetch settings, weight residency, the buffer pool and traces, in one process (the
multi-rank prefetch checks are scenarios in tests/mpi_worker.py)."""

from __future__ import annotations

import gc
import json

import numpy as np
import pytest

import hsdp
from hsdp import models
from hsdp.distributed import init_process_group

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
    from hsdp import schedule

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
