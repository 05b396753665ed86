"""Pins of today's behaviour ahead of a refactor, one process: the prefetch order, departures
from the recorded order, the buffer pool's eviction, the flat layout and the launcher's exit
status. Each test names the deliberate bug ("mutation") it was checked to catch."""

from __future__ import annotations

import gc
import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest

import hsdp
import hsdp._C
from hsdp.world import launch
from hsdp import models, nn
from hsdp.world.distributed import init_process_group

init_process_group("single")
TINY = models.DiTConfig.preset("tiny")
ALIGN = 64  # HSDP_ALIGN: a unit's buffer is padded to a multiple of ALIGN * S
def slot_align(nbytes: int) -> int:  # hsdp_slot_align: where a parameter of nbytes starts
    return 256 if nbytes >= 256 else 128 if nbytes >= 128 else ALIGN


@pytest.fixture(autouse=True)
def _clean():
    capacity = hsdp.memory_stats()["pool_capacity"]
    yield
    gc.collect()
    hsdp.empty_pool()
    hsdp._C.set_pool_capacity(capacity)


class Block(nn.Module):
    """x -> tanh(fc(x)) at width 8, plus an unused Linear that sets the unit's size."""

    def __init__(self, extra: int) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.side = nn.Linear(1, extra)

    def forward(self, x):
        return np.tanh(self.fc(x))


class Chain(nn.Module):
    """A root Linear and four unit blocks of distinct sizes; ``skip`` (an index or a set of
    indices) leaves blocks out of a forward, and ``probe(i)`` runs after block i."""

    _hsdp_shard_conditions = [lambda name, m: re.fullmatch(r"layers\.\d+", name) is not None]

    def __init__(self, extras: tuple[int, ...] = (8, 40, 24, 56), seed: int = 0) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.layers = nn.ModuleList(Block(e) for e in extras)
        rng = np.random.default_rng(seed)
        for p in self.parameters():
            p.data = rng.standard_normal(p.shape).astype(np.float32)
        self.skip: int | set[int] | None = None
        self.probe = None

    def forward(self, x):
        x = self.inp(x)
        skip = self.skip if isinstance(self.skip, set) else {self.skip}
        for i, layer in enumerate(self.layers):
            if i not in skip:
                x = layer(x)
                if self.probe is not None:
                    self.probe(i)
        return x


CHAIN_X = (np.linspace(-1.0, 1.0, 8, dtype=np.float32).reshape(2, 4),)


def sharded_chain(**kw) -> Chain:
    model = Chain()
    kw.setdefault("param_dtype", "float32")  # exact against the unsharded reference
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, **kw))
    return model


def names(units) -> list[str]:
    return [u.fqn for u in units]


# ------------------------------------------------------------------- prefetch order (1, 2)


def _cap(kind: str) -> int:
    """Room for the root, the block computing and one more block (as test_overlap's cap)."""
    probe = models.make_model("tiny", seed=0) if kind == "tiny" else Chain()
    hsdp.apply_hsdp_to_model(probe, hsdp.HSDPInferenceConfig(enabled=True, param_dtype="float32"))
    units = hsdp.get_units(probe)
    cap = units[-1].full_bytes + 2 * max(u.full_bytes for u in units[:-1])
    del probe, units
    gc.collect()
    return cap


@pytest.mark.parametrize("kind", ["tiny", "chain"])
@pytest.mark.parametrize("depth,capped", [(0, False), (1, False), (2, False), (3, False), (3, True)])
def test_gathers_are_submitted_in_recorded_order(kind, depth, capped):
    """Mutations 1 (window prefetched in reverse) and 2 (prefetch before the entering unit's own
    unshard, so blocks.0 is submitted before the root): in a steady forward, gathers are
    submitted strictly in the recorded order, at every depth and under a byte cap."""
    cap = _cap(kind) if capped else None
    if kind == "tiny":
        model = models.make_model("tiny", seed=0)
        x = models.make_inputs(TINY, seed=0)
    else:
        model, x = Chain(), CHAIN_X
    expect = model(*x)
    hsdp.apply_hsdp_to_model(
        model, hsdp.HSDPInferenceConfig(enabled=True, param_dtype="float32", prefetch_depth=depth,
                                        max_unsharded_bytes=cap)
    )
    sched = model._hsdp_context.schedule
    assert np.array_equal(model(*x), expect)  # the recording forward
    assert names(sched.order)[0] == "" and len(sched.order) == len(hsdp.get_units(model))
    before, t0 = sched.prefetches, hsdp._C.now_ns()
    assert np.array_equal(model(*x), expect)
    submits = [u.unit.gather_times()[0] for u in sched.order]
    assert submits[0] > t0  # every unit gathered again in this forward
    assert all(a < b for a, b in zip(submits, submits[1:])), list(zip(names(sched.order), submits))
    if depth == 0:
        assert sched.prefetches == 0
    else:
        assert sched.prefetches - before == len(sched.order) - 1  # every block gathered ahead


# ------------------------------------------------------------ departures from the order (3, 4)


def test_departure_keeps_the_prefix_and_records_the_entering_unit():
    """Mutations 3 (a departing unit left out of the order) and 4 (the kept prefix discarded on
    re-recording): what schedule.order holds during and after a forward that skips a block,
    and after the next full forward; outputs equal the unsharded model's."""
    ref = Chain()
    expect = {"full": ref(*CHAIN_X)}
    ref.skip = 1
    expect["skip1"] = ref(*CHAIN_X)
    model = sharded_chain(prefetch_depth=2)
    sched = model._hsdp_context.schedule
    full = ["", "layers.0", "layers.1", "layers.2", "layers.3"]
    seen: dict[int, tuple[list[str], bool]] = {}
    model.probe = lambda i: seen.__setitem__(i, (names(sched.order), sched.recording))

    assert np.array_equal(model(*CHAIN_X), expect["full"])
    assert names(sched.order) == full and not sched.recording and sched.rerecords == 0
    assert np.array_equal(model(*CHAIN_X), expect["full"])  # steady

    model.skip = 1
    seen.clear()
    assert np.array_equal(model(*CHAIN_X), expect["skip1"])
    # at layers.2, where the forward departed: the prefix kept, the entering unit appended
    assert seen[2] == (["", "layers.0", "layers.2"], True)
    assert names(sched.order) == ["", "layers.0", "layers.2", "layers.3"]
    assert not sched.recording and sched.rerecords == 1

    model.skip = None
    seen.clear()
    assert np.array_equal(model(*CHAIN_X), expect["full"])
    # a known order agrees with this forward at layers.1: it goes on with it, no re-record
    assert seen[1] == (full, False)
    assert names(sched.order) == full and not sched.recording
    assert (sched.rerecords, sched.switches) == (1, 1)
    assert not any(u.unit.holds_buffers for u in hsdp.get_units(model))


def test_forward_ending_early_rerecords_from_there():
    """Mutation 4 (the kept prefix discarded): a forward that skips the last block leaves the
    recorded prefix and records again next time; the full forward then switches back."""
    ref = Chain()
    full_out = ref(*CHAIN_X)
    ref.skip = 3
    short_out = ref(*CHAIN_X)
    model = sharded_chain(prefetch_depth=1)
    sched = model._hsdp_context.schedule
    model(*CHAIN_X)
    model.skip = 3
    assert np.array_equal(model(*CHAIN_X), short_out)
    assert names(sched.order) == ["", "layers.0", "layers.1", "layers.2"]
    assert sched.recording and sched.rerecords == 1
    assert np.array_equal(model(*CHAIN_X), short_out)  # records the short order
    assert names(sched.order) == ["", "layers.0", "layers.1", "layers.2"] and not sched.recording
    model.skip = None
    assert np.array_equal(model(*CHAIN_X), full_out)
    assert names(sched.order) == ["", "layers.0", "layers.1", "layers.2", "layers.3"]
    assert (sched.rerecords, sched.switches, sched.recording) == (1, 1, False)


@pytest.mark.parametrize(
    "pattern,depth,capped",
    [((None, 1), 2, False), ((None, 1), 1, False), ((None, 1), 3, True), ((None, 1, {0, 2}), 2, False)],
)
def test_steady_alternating_pattern_stops_rerecording_and_allocating(pattern, depth, capped):
    """The issue's "a steady alternating pattern stops re-recording and allocating": forwards
    cycling through patterns that skip blocks settle on the recorded orders (schedule.py keeps
    the last few) and allocate no buffer once each pattern has run; outputs stay exact."""
    ref = Chain()
    expect = []
    for skip in pattern:
        ref.skip = skip
        expect.append(ref(*CHAIN_X))
    model = sharded_chain(prefetch_depth=depth, max_unsharded_bytes=_cap("chain") if capped else None)
    sched = model._hsdp_context.schedule
    for k, skip in enumerate(pattern):  # the first round records each pattern once
        model.skip = skip
        assert np.array_equal(model(*CHAIN_X), expect[k])
    rerecords, allocs = sched.rerecords, hsdp.memory_stats()["buffer_allocs"]
    assert rerecords == len(pattern) - 1
    for _ in range(3):
        for k, skip in enumerate(pattern):
            model.skip = skip
            prefetches = sched.prefetches
            assert np.array_equal(model(*CHAIN_X), expect[k]), skip
            assert sched.prefetches > prefetches  # prefetching goes on across departures
    assert sched.rerecords == rerecords
    assert hsdp.memory_stats()["buffer_allocs"] == allocs
    assert hsdp.memory_stats()["unsharded_bytes"] == 0 and not sched.recording


# ------------------------------------------------------------------------- the pool (5)


def test_full_pool_evicts_the_oldest_idle_buffer():
    """Mutation 5 (a full pool evicting the newest idle buffer): with room for two, releasing
    three buffers of distinct sizes keeps the last two."""
    group = hsdp.init_device_mesh("cpu", (1, 1)).shard_group
    units = [hsdp._C.Unit(group, ["float32"], [(n,)], name=f"u{n}") for n in (16, 32, 48)]
    sizes = [u.total_bytes for u in units]
    assert sizes == [64, 128, 192]
    hsdp.empty_pool()
    hsdp._C.set_pool_capacity(2)
    pooled = []
    for u in units:
        u.unshard()
        u.reshard()
        pooled.append(hsdp.memory_stats()["pooled_bytes"])
    assert pooled == [64, 64 + 128, 128 + 192]
    assert hsdp.memory_stats()["unsharded_bytes"] == 0
    allocs = hsdp.memory_stats()["buffer_allocs"]
    units[2].unshard()  # the newest is still pooled: reused, not allocated
    units[2].reshard()
    assert hsdp.memory_stats()["buffer_allocs"] == allocs
    units[0].unshard()  # the oldest was evicted: allocated again
    units[0].reshard()
    assert hsdp.memory_stats()["buffer_allocs"] == allocs + 1


# ------------------------------------------------------------------------ the layout (6)

DTYPES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "float64": 8,
    "bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "uint32": 4, "int32": 4,
    "uint64": 8, "int64": 8,
}


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@pytest.mark.parametrize("seed", range(4))
def test_unit_layout_matches_the_formula(seed):
    """Mutation 6 (parameters after the first placed 64 bytes further on): each parameter
    starts at its predecessor's end rounded up to 256 (128, 64 when smaller than that), the total is padded to 64 * S (S = 1
    here; csrc/tests/test_layout.c covers S up to 8)."""
    rng = np.random.default_rng(seed)
    group = hsdp.init_device_mesh("cpu", (1, 1)).shard_group
    n = int(rng.integers(2, 12))
    dts = [str(d) for d in rng.choice(list(DTYPES), n)]
    shapes = []
    for _ in range(n):
        dims = rng.integers(0 if rng.random() < 0.15 else 1, 9, size=int(rng.integers(1, 4)))
        shapes.append(tuple(int(d) for d in dims))
    unit = hsdp._C.Unit(group, dts, shapes, name=f"layout{seed}")
    nbytes = [int(np.prod(s, dtype=np.int64)) * DTYPES[d] for s, d in zip(shapes, dts)]
    offsets, end = [], 0
    for nb in nbytes:
        offsets.append(round_up(end, slot_align(nb)))
        end = offsets[-1] + nb
    assert list(unit.offsets) == offsets
    assert list(unit.nbytes) == nbytes
    assert unit.total_bytes == round_up(end, ALIGN) == unit.chunk_bytes


def test_unit_layout_fixed_example():
    """Mutation 6: a hand-computed layout (7 float32, 1 bfloat16, 0 float32, 13 float8, 75 float32)."""
    group = hsdp.init_device_mesh("cpu", (1, 1)).shard_group
    unit = hsdp._C.Unit(group, ["float32", "bfloat16", "float32", "float8_e4m3fn", "float32"],
                        [(7,), (1,), (0,), (13,), (75,)])
    assert list(unit.offsets) == [0, 64, 128, 128, 256]
    assert list(unit.nbytes) == [28, 2, 0, 13, 300]
    assert (unit.total_bytes, unit.chunk_bytes) == (576, 576)


# ----------------------------------------------------------------- the launcher's status (7)


def fake(tmp_path: Path, name: str, body: str) -> str:
    exe = tmp_path / name
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(0o755)
    return str(exe)


@pytest.mark.parametrize("sig,status", [("TERM", 143), ("KILL", 137)])
def test_mpiexec_killed_by_a_signal_exits_128_plus_n(tmp_path, sig, status):
    """Mutation 7 (1 instead of 128 + N when mpiexec dies of a signal): reported as a shell
    does, 143 for SIGTERM and 137 for SIGKILL, from _run and from the launcher's main."""
    assert status == 128 + getattr(signal, f"SIG{sig}")
    exe = fake(tmp_path, "mpiexec", f"kill -{sig} $$")
    assert launch._run([exe], dict(os.environ)) == status
    script = tmp_path / "noop.py"
    script.write_text("")
    assert launch.main(["--mpiexec", exe, "-n", "2", str(script)]) == status


def test_mpiexec_exit_status_is_forwarded_unchanged(tmp_path):
    """Mutation 7's neighbour: a plain non-zero exit is returned as is, not as a signal."""
    assert launch._run([fake(tmp_path, "mpiexec", "exit 5")], dict(os.environ)) == 5
    assert launch._run([fake(tmp_path, "ok", "exit 0")], dict(os.environ)) == 0


_EXPLICIT = """
import hsdp
from hsdp import models
hsdp.distributed.init_process_group("single")
model = models.make_model("tiny", seed=0)
hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, param_dtype="float32"))  # one buffer a gather
before = hsdp.memory_stats()
for _ in range(9):
    hsdp.unshard(model.blocks[0])
    hsdp.reshard(model.blocks[0])
after = hsdp.memory_stats()
print(before["pool_capacity"], after["buffer_allocs"] - before["buffer_allocs"], after["pooled_bytes"] > 0)
"""


def test_explicit_unshard_and_reshard_reuse_a_buffer_with_the_defaults():
    """In a fresh process (the default pool, no forward has sized it), nine explicit
    unshard/reshard cycles of one block allocate one buffer, not nine."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _EXPLICIT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "1", "True"], out.stdout
