"""The seams of the refactor, pinned: the C backend registry (single process, and MPI on 2
and 4 ranks through tests/seams_worker.py), the C unit's compute dtypes / binding / device
arguments and its buffers, the tensor adapter protocol (the whole API run through a
recording adapter that binds in Python, bit for bit against the plain NumPy path), and the
one source list the Makefile and setup.py share."""

from __future__ import annotations

import ast
import gc
import os
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import hsdp
from hsdp import _C, adapters, models, nn
from hsdp.adapters import NumpyAdapter, TensorAdapter
from hsdp.engine import registry
from hsdp.world.distributed import init_process_group
from hsdp.models.quant import VideoDiTQuantized

from mpirun import ROOT, run_ranks

init_process_group("single")
TINY = models.DiTConfig.preset("tiny")
NCCL_REASON = "the NCCL backend is built but its libraries are not loaded"


@pytest.fixture(autouse=True)
def _clean():
    yield
    gc.collect()
    hsdp.empty_pool()


def group():
    return hsdp.init_device_mesh("cpu", (1, 1)).shard_group


def buffer_behind(arr):
    """The object at the end of an array's base chain (through a memoryview, if any)."""
    b = arr
    while isinstance(b, np.ndarray):
        b = b.base
    return b.obj if isinstance(b, memoryview) else b


# =========================================================================== 1. backend registry


def test_c_registry_lists_backends_in_order():
    """_C.backends(): single, mpi, nccl, fakedev in registry order; single usable; nccl built (every
    build has it: csrc/cuda_abi.h) but not usable until hsdp.nccl loads its libraries; the
    test-only fakedev only with HSDP_FAKE_DEVICE=1."""
    assert _C.nccl_built()
    rows = _C.backends()
    assert isinstance(rows, tuple) and all(isinstance(r, tuple) and len(r) == 3 for r in rows)
    assert [r[0] for r in rows] == ["single", "mpi", "nccl", "fakedev"]
    assert rows[0] == ("single", True, None)
    assert rows[1] == ("mpi", True, None)  # this checkout is built with MPI (make build)
    name, usable, reason = rows[2]
    assert name == "nccl" and usable is False and reason.startswith(NCCL_REASON)
    if os.environ.get("HSDP_FAKE_DEVICE") != "1":
        assert rows[3] == ("fakedev", False, rows[3][2]) and "set HSDP_FAKE_DEVICE=1" in rows[3][2]


def test_device_info_comes_from_the_device_tables():
    """Where each backend's buffers live is asked of C: host for single and MPI; NCCL's device is
    'cuda' (DLPack kDLCUDA); fakedev's claims to be a device but is viewed as CPU memory."""
    host = {"kind": "host", "device": "host", "framework": "cpu", "dlpack": (1, 0), "live_bytes": None}
    assert _C.device_info("single") == {"backend": "single", **host}
    assert _C.device_info("mpi") == {"backend": "mpi", **host}
    nccl = _C.device_info("nccl")
    assert (nccl["kind"], nccl["device"], nccl["framework"], nccl["dlpack"][0]) == ("device", "cuda", "cuda", 2)
    fake = _C.device_info("fakedev")
    assert (fake["kind"], fake["device"], fake["framework"], fake["dlpack"]) == ("device", "fakedev", "cpu", (1, 0))
    assert group().device_info == _C.device_info("single")
    with pytest.raises(ValueError, match="unknown backend 'tcp'"):
        _C.device_info("tcp")


def test_distributed_backends_maps_name_to_reason():
    """hsdp.distributed.backends() is {name: None if usable else the reason}; for NCCL the reason
    comes from loading it (no GPU here: cudaGetDeviceCount's error)."""
    got = hsdp.distributed.backends()
    assert list(got) == [r[0] for r in _C.backends()]
    rows = {n: (None if ok else why) for n, ok, why in _C.backends()}
    assert {k: v for k, v in got.items() if k != "nccl"} == {k: v for k, v in rows.items() if k != "nccl"}
    assert got["single"] is None
    import torch

    if not torch.cuda.is_available():
        assert got["nccl"].startswith("no usable GPU for the NCCL backend"), got["nccl"]


def test_unknown_and_unbuilt_backends_are_refused():
    """An unknown name is a ValueError listing the registry; nccl is NotImplementedError naming NCCL."""
    with pytest.raises(ValueError, match=re.escape("unknown backend 'tcp'; expected one of 'single', 'mpi', 'nccl'")):
        _C.ProcessGroup("tcp")
    with pytest.raises(NotImplementedError, match="NCCL"):
        _C.ProcessGroup("nccl")
    with pytest.raises(ValueError, match=re.escape("one of 'single', 'mpi', 'nccl', 'fakedev', got 'tcp'")):
        hsdp.distributed.init_process_group("tcp")


def test_single_group_properties_and_collectives():
    """The single backend's group: backend/rank/size, no overlap, and each collective a copy."""
    g = group()
    assert (g.backend, g.rank, g.size, g.overlaps) == ("single", 0, 1, False)
    assert g.barrier() is None
    a = np.arange(5, dtype=np.float64)
    g.broadcast(a, 0)
    assert np.array_equal(a, np.arange(5))
    send = np.arange(6, dtype=np.int32)
    recv = np.zeros(6, np.int32)
    g.all_gather(send, recv)
    assert np.array_equal(recv, send)
    recv[:] = 0
    g.all_to_all(send, recv)
    assert np.array_equal(recv, send)


def test_group_collectives_validate_their_arrays():
    """all_to_all refuses overlapping send/recv; both collectives name bytes on a wrong size."""
    g = group()
    send = np.arange(8, dtype=np.int32)
    with pytest.raises(ValueError, match="overlap"):
        g.all_to_all(send, send)
    shared = np.arange(16, dtype=np.int32)
    with pytest.raises(ValueError, match="overlap"):  # partly overlapping views of one array
        g.all_to_all(shared[:8], shared[4:12])
    with pytest.raises(ValueError, match=r"recv holds 12 bytes.*need 32"):
        g.all_to_all(send, np.zeros(3, np.int32))
    with pytest.raises(ValueError, match=r"recv holds 28 bytes.*need 32"):
        g.all_gather(send, np.zeros(7, np.int32))
    with pytest.raises(TypeError, match="send must be a C-contiguous NumPy array"):
        g.all_to_all(send[::2], np.zeros(4, np.int32))


def test_device_mesh_device_types():
    """init_device_mesh: 'cuda' with no GPU is RuntimeError naming NCCL (NotImplementedError where
    NCCL is not built or installed); an unknown type is ValueError."""
    reason = hsdp.distributed.backend_reason("nccl")
    no_gpu = reason is not None and reason.startswith("no usable GPU for the NCCL backend")
    with pytest.raises(RuntimeError if no_gpu else NotImplementedError, match="NCCL"):
        hsdp.init_device_mesh("cuda", (1, 1))
    with pytest.raises(ValueError, match="device_type must be one of 'cpu', 'cuda', got 'tpu'"):
        hsdp.init_device_mesh("tpu", (1, 1))
    assert hsdp.init_device_mesh("cpu", (1, 1)).shard_group.backend == "single"


@pytest.mark.parametrize("n", [2, 4])
def test_mpi_all_to_all_and_overlap_on_ranks(n):
    """Under mpiexec: backend 'mpi', overlaps True, all_to_all routes each (src, dst) block right."""
    proc = run_ranks(n, "tests/seams_worker.py", timeout=120)
    done = set(re.findall(rf"rank (\d+)/{n} seams OK", proc.stdout))
    assert done == {str(r) for r in range(n)}, proc.stdout


# =========================================================================== 2. the C unit


class Slotted:
    __slots__ = ("_data",)


class Plain:
    pass


def test_unit_binding_needs_a_numpy_compute_dtype():
    """bind_attr with a compute dtype NumPy lacks (bfloat16) is a TypeError at construction."""
    with pytest.raises(TypeError, match="computed in bfloat16, which has no NumPy type"):
        _C.Unit(group(), ["bfloat16"], [(4,)], compute_dtypes=["bfloat16"], params=(Plain(),), bind_attr="x")


def test_unit_constructor_validates_compute_dtypes_device_and_binding():
    """A non-float compute dtype is TypeError; wrong length, unknown device, bind_attr without params ValueError."""
    g = group()
    with pytest.raises(TypeError, match="stored as float32 and cannot be computed in int32"):
        _C.Unit(g, ["float32"], [(4,)], compute_dtypes=["int32"])
    with pytest.raises(ValueError, match="got 2 compute_dtypes but 1 shapes"):
        _C.Unit(g, ["float32"], [(4,)], compute_dtypes=["float32", "float32"])
    with pytest.raises(ValueError, match="device must be one of 'host', 'cuda'.*, got 'tpu'"):
        _C.Unit(g, ["float32"], [(4,)], device="tpu")
    with pytest.raises(ValueError, match="bind_attr needs params"):
        _C.Unit(g, ["float32"], [(4,)], bind_attr="_data")
    with pytest.raises(TypeError):  # compute_dtypes, bind_attr and device are keyword-only
        _C.Unit(g, ["float32"], [(4,)], None, "n", ["float32"])


def test_unit_defaults_compute_in_storage_dtype_on_host():
    """Without compute_dtypes each parameter computes in its storage dtype: nothing widened; device 'host'."""
    u = _C.Unit(group(), ["bfloat16", "float32", "float8_e4m3fn"], [(3,), (2, 2), (5,)])
    assert u.compute_dtypes == ("bfloat16", "float32", "float8_e4m3fn")
    assert u.widened_bytes == 0 and u.device == "host"
    assert u.view_specs == tuple((0, off) for off in u.offsets)
    assert u.buffers() is None


def test_cuda_unit_on_single_backend_stays_sharded():
    """device='cuda' on 'single': built fine, unshard raises NotImplementedError and changes nothing."""
    u = _C.Unit(group(), ["float32"], [(16,)], device="cuda", params=(Plain(),))
    assert u.device == "cuda"
    # NumPy views of device memory, or a host conversion of it, are refused up front
    with pytest.raises(ValueError, match="bind_attr makes NumPy views, which need host memory"):
        _C.Unit(group(), ["float32"], [(16,)], device="cuda", params=(Plain(),), bind_attr="_data")
    with pytest.raises(ValueError, match="conversion runs on the host"):
        _C.Unit(group(), ["bfloat16"], [(16,)], device="cuda", compute_dtypes=["float32"])
    before = hsdp.memory_stats()
    for call in (u.unshard, u.start_unshard):
        with pytest.raises(NotImplementedError, match=re.escape("backend 'single' has no device: it cannot allocate")):
            call()
        assert not u.is_unsharded and not u.holds_buffers and not u.is_pending and u.buffers() is None
        after = hsdp.memory_stats()
        assert after["unsharded_bytes"] == before["unsharded_bytes"]
        assert after["buffer_allocs"] == before["buffer_allocs"]


def test_widened_bytes_for_float32_compute():
    """bf16 storage computed in float32: one converted slot per widened parameter, each 64-byte aligned."""
    g = group()
    for n in (16, 100):
        u = _C.Unit(g, ["bfloat16"], [(n,)], compute_dtypes=["float32"])
        assert u.compute_dtypes == ("float32",) and u.view_specs == ((1, 0),)
        # the converted buffer ends where its last slot ends (the allocator pads to 64 itself)
        assert u.widened_bytes == 4 * n
    u = _C.Unit(g, ["bfloat16", "float32", "bfloat16"], [(5,), (3,), (7,)],
                compute_dtypes=["float32", "float32", "float32"])
    assert u.view_specs == ((1, 0), (0, u.offsets[1]), (1, 64))
    assert u.widened_bytes == 64 + 4 * 7


def test_unshard_without_binding_exports_the_gathered_bytes():
    """compute bf16 and bind_attr None: nothing widened; buffers()[0] holds the bf16 encoding, read-only."""
    n = 37
    values = np.linspace(-5, 5, n).astype(np.float32)
    obj = Plain()
    u = _C.Unit(group(), ["bfloat16"], [(n,)], compute_dtypes=["bfloat16"], params=(obj,))
    u.write(0, values)
    assert u.widened_bytes == 0 and u.buffers() is None
    u.unshard()
    assert not hasattr(obj, "_data") and not hasattr(obj, "x")  # the unit bound nothing
    gathered, converted = u.buffers()
    assert converted is None and type(gathered).__name__ == "_Buffer"
    assert gathered.nbytes == u.total_bytes and gathered.device == "host" and gathered.address % 64 == 0
    mv = memoryview(gathered)
    assert mv.readonly and mv.nbytes == gathered.nbytes
    with pytest.raises(TypeError):
        mv[0] = 1
    raw = np.frombuffer(gathered, dtype=np.uint16, offset=u.view_specs[0][1], count=n)
    assert np.array_equal(raw, _C.encode(values, "bfloat16"))
    assert not raw.flags.writeable
    del raw, mv, gathered
    u.reshard()
    assert u.buffers() is None and not u.is_unsharded


@pytest.mark.parametrize("cls", [Slotted, Plain], ids=["slots", "plain"])
def test_unit_binds_read_only_views_on_simple_objects(cls):
    """bind_attr set: unshard sets read-only views whose base is the unit's _Buffer; reshard sets None."""
    a, b = cls(), cls()
    va = np.linspace(-1, 1, 12).astype(np.float32).reshape(3, 4)
    vb = np.arange(5, dtype=np.float32) / 3
    u = _C.Unit(group(), ["bfloat16", "float32"], [(3, 4), (5,)], compute_dtypes=["float32", "float32"],
                params=(a, b), bind_attr="_data")
    u.write(0, va)
    u.write(1, vb)
    u.unshard()
    gathered, converted = u.buffers()
    assert converted is not None and converted.nbytes == u.widened_bytes
    for obj, which, expect in ((a, 1, _C.round_to(va, "bfloat16")), (b, 0, vb)):
        view = obj._data
        assert isinstance(view, np.ndarray) and view.dtype == np.float32 and view.shape == expect.shape
        assert not view.flags.writeable and np.array_equal(view, expect)
        assert buffer_behind(view) is (gathered, converted)[which]
        assert view.ctypes.data == (gathered, converted)[which].address + u.view_specs[(a, b).index(obj)][1]
    with pytest.raises(ValueError):
        a._data[0, 0] = 1.0
    del gathered, converted, view
    u.reshard()
    assert a._data is None and b._data is None and u.buffers() is None


def test_failed_bind_leaves_unit_sharded_and_params_unset():
    """An object that cannot take bind_attr: unshard raises and no parameter is left half-bound."""
    ok, bad = Plain(), Slotted()
    u = _C.Unit(group(), ["float32", "float32"], [(4,), (4,)], params=(ok, bad), bind_attr="weight_view")
    before = hsdp.memory_stats()["unsharded_bytes"]
    with pytest.raises(AttributeError):
        u.unshard()
    assert not u.is_unsharded and not u.holds_buffers
    assert getattr(ok, "weight_view", None) is None
    assert hsdp.memory_stats()["unsharded_bytes"] == before


# =========================================================================== 3. the adapter protocol

PROTOCOL = frozenset(n for n, v in vars(TensorAdapter).items() if callable(v) and not n.startswith("_"))


class _Marked:
    """Models the recording adapter owns."""


class MarkedDiT(_Marked, models.VideoDiT):
    pass


class MarkedIgnored(_Marked, models.VideoDiTIgnoredTimeEmbedder):
    pass


class MarkedQuant(_Marked, VideoDiTQuantized):
    pass


PLAIN = {MarkedDiT: "plain", MarkedIgnored: "ignored", MarkedQuant: "quantized"}


def _recorded(name):
    base = getattr(NumpyAdapter, name)

    def method(self, *args, **kwargs):
        self.calls[name] += 1
        return base(self, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


class RecordingAdapter(NumpyAdapter):
    """The NumPy adapter binding in Python (bind_attr None), counting every protocol call."""

    name = "recording"
    bind_attr = None

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def owns(self, module):
        self.calls["owns"] += 1
        return isinstance(module, _Marked)


for _name in PROTOCOL - {"owns"}:
    setattr(RecordingAdapter, _name, _recorded(_name))


@pytest.fixture
def rec():
    adapter = RecordingAdapter()
    adapters.register_adapter(adapter)
    yield adapter
    adapters.unregister_adapter(adapter)


def marked(cls=MarkedDiT, seed=0):
    m = cls(TINY)
    models.init_weights(m, seed)
    return m


def plain(cls=MarkedDiT, seed=0):
    return models.make_model("tiny", variant=PLAIN[cls], seed=seed)


def cfg(**kw):
    return hsdp.HSDPInferenceConfig(enabled=True, **kw)


def rounded_reference(variant="plain", keep=()):
    """The unsharded model holding what a bfloat16 shard holds."""
    m = models.make_model("tiny", variant=variant, seed=0)
    for name, p in m.named_parameters():
        if p.is_floating_point() and p.ndim > 0 and not name.startswith(keep):
            p.data = _C.round_to(np.ascontiguousarray(p.data, dtype=np.float32), "bfloat16")
    return m


INPUTS = [models.make_inputs(TINY, seed=s) for s in (1, 2)]


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def no_views(model):
    return all(p._data is None for u in hsdp.get_units(model) for p in u.params)


def check_bound(model, units=None):
    """Every parameter of the units is a read-only view of one of its unit's buffers."""
    for u in units or hsdp.get_units(model):
        bufs = u.unit.buffers()
        assert bufs is not None, u.label
        for p, (which, off) in zip(u.params, u.unit.view_specs):
            assert not p._data.flags.writeable
            assert buffer_behind(p._data) is bufs[which], u.label
            assert p._data.ctypes.data == bufs[which].address + off


# ---- scenarios: each runs part of the API with the recording adapter and checks it bit for bit


def scenario_forwards(rec, param_dtype, depth):
    m, p = marked(), plain()
    c = cfg(param_dtype=param_dtype, prefetch_depth=depth)
    hsdp.apply_hsdp_to_model(m, c)
    hsdp.apply_hsdp_to_model(p, c)
    assert all(u.adapter is rec and u._binds for u in hsdp.get_units(m))
    assert all(u.adapter is adapters.NUMPY and not u._binds for u in hsdp.get_units(p))
    for a, b in zip(hsdp.get_units(m), hsdp.get_units(p)):
        assert a.unit.compute_dtypes == b.unit.compute_dtypes and a.unit.view_specs == b.unit.view_specs
        assert same(a.unit.shard_bytes(), b.unit.shard_bytes()), a.label
    ref = models.make_model("tiny", seed=0) if param_dtype == "float32" else rounded_reference()
    expect = [ref(*x) for x in INPUTS]
    out = m(*INPUTS[0])  # the recording forward
    assert same(out, p(*INPUTS[0])) and same(out, expect[0])
    assert no_views(m)
    allocs = hsdp.memory_stats()["buffer_allocs"]
    for _ in range(2):
        for x, e in zip(INPUTS, expect):
            got = m(*x)
            assert same(got, p(*x)) and same(got, e)
            assert no_views(m) and not any(u.unit.holds_buffers for u in hsdp.get_units(m))
    assert hsdp.memory_stats()["buffer_allocs"] == allocs  # steady forwards: buffers come from the pool
    assert hsdp.memory_stats()["unsharded_bytes"] == 0
    if depth:
        assert m._hsdp_context.schedule.prefetches > 0
    assert rec.calls["bind"] == rec.calls["unbind"] > 0


def scenario_output_dtype(rec):
    for out_dtype in ("float16", "bfloat16"):
        m, p = marked(), plain()
        c = cfg(param_dtype="float32", output_dtype=out_dtype)
        hsdp.apply_hsdp_to_model(m, c)
        hsdp.apply_hsdp_to_model(p, c)
        ref = models.make_model("tiny", seed=0)(*INPUTS[0])
        expect = ref.astype(np.float16) if out_dtype == "float16" else _C.round_to(ref, "bfloat16")
        for _ in range(2):
            got = m(*INPUTS[0])
            assert same(got, p(*INPUTS[0])) and same(got, expect), out_dtype


def scenario_explicit(rec):
    m, p = marked(), plain()
    for model in (m, p):
        hsdp.apply_hsdp_to_model(model, cfg())
    ref = rounded_reference()
    refp = dict(ref.named_parameters())
    x = INPUTS[0]
    expect = ref(*x)
    # one block, explicitly: views stay across forwards until reshard
    hsdp.unshard(m.blocks[0])
    hsdp.unshard(p.blocks[0])
    block_units = [m.blocks[0]._hsdp_unit]
    check_bound(m, block_units)
    for (n, q), (_, r) in zip(m.blocks[0].named_parameters(), p.blocks[0].named_parameters()):
        assert same(q.data, r.data) and same(q.data, refp[f"blocks.0.{n}"].data), n
    assert same(m(*x), expect) and same(m(*x), p(*x))
    assert m.blocks[0]._hsdp_unit.unit.is_unsharded
    check_bound(m, block_units)
    hsdp.reshard(m.blocks[0])
    hsdp.reshard(p.blocks[0])
    assert no_views(m) and all(q._data is None for q in m.blocks[0].parameters())
    # the whole model, asynchronously
    handle = hsdp.unshard(m, recurse=True, async_op=True)
    handle.wait()
    assert handle.is_completed()
    check_bound(m)
    for n, q in m.named_parameters():
        assert same(q.data, refp[n].data), n
    assert same(m(*x), expect)
    hsdp.reshard(m, recurse=True)
    assert no_views(m) and hsdp.memory_stats()["unsharded_bytes"] == 0
    # the gathered state dict: copies, equal to the reference, and the units resharded again
    full = hsdp.full_state_dict(m)
    assert set(full) == set(refp) and all(same(full[n], refp[n].data) for n in refp)
    assert no_views(m) and hsdp.memory_stats()["unsharded_bytes"] == 0
    # resident: gathered once, every step uses the same views
    with hsdp.resident(m) as held:
        assert held is m
        check_bound(m)
        gathers = hsdp.memory_stats()["gathers"]
        for _ in range(2):
            assert same(m(*x), expect)
        assert hsdp.memory_stats()["gathers"] == gathers
    assert no_views(m) and not any(u.unit.holds_buffers for u in hsdp.get_units(m))
    assert rec.calls["bind"] == rec.calls["unbind"]


def scenario_streaming(rec):
    m, whole = marked(), plain()
    c = cfg()
    hsdp.apply_hsdp_to_model(whole, c)
    ctx = hsdp.prepare_hsdp_shard_context(m, c)
    assert ctx.adapter is rec
    for block in m.blocks:
        hsdp.shard_hsdp_module(block, ctx)
    hsdp.finalize_hsdp_root(m, ctx)
    assert [u.fqn for u in hsdp.get_units(m)] == [u.fqn for u in hsdp.get_units(whole)]
    for a, b in zip(hsdp.get_units(m), hsdp.get_units(whole)):
        assert same(a.unit.shard_bytes(), b.unit.shard_bytes()), a.label
    for x in INPUTS:
        assert same(m(*x), whole(*x))
    assert no_views(m)


def scenario_ignored(rec):
    m, p = marked(MarkedIgnored), plain(MarkedIgnored)
    for model in (m, p):
        hsdp.apply_hsdp_to_model(model, cfg(), "cpu")
    expect = rounded_reference("ignored", keep=("time_embedder.",))(*INPUTS[0])
    for _ in range(2):
        assert same(m(*INPUTS[0]), p(*INPUTS[0])) and same(m(*INPUTS[0]), expect)
    assert all(q.data.flags.writeable for q in m.time_embedder.parameters())  # kept whole


def _meta(cls):
    with nn.meta_init():
        return cls(TINY) if cls is not None else models.make_model("tiny", variant="quantized")


def scenario_load(rec, tmp_path):
    src = models.make_model("tiny", variant="quantized", seed=0)
    path = tmp_path / "q.safetensors"
    hsdp.save_checkpoint(src, path)
    m, p = _meta(MarkedQuant), _meta(None)
    assert hsdp.load_model_sharded(m, path, cfg(), "cpu", progress=False) is m
    hsdp.load_model_sharded(p, path, cfg(), "cpu", progress=False)
    for a, b in zip(hsdp.get_units(m), hsdp.get_units(p)):
        assert same(a.unit.shard_bytes(), b.unit.shard_bytes()), a.label
    hsdp.apply_hsdp_to_model(src, cfg(), "cpu")
    for x in INPUTS:
        assert same(m(*x), p(*x)) and same(m(*x), src(*x))
    assert no_views(m)
    whole = [q for q in src.parameters() if q._hsdp_state is None]
    assert rec.calls["values"] == rec.calls["assign"] == len(whole) > 0
    assert rec.calls["restore"] == 0


def scenario_exchanges(rec):
    """hsdp.parallel's exchanges, written once over the adapter, on a one-rank group: the
    Ulysses pair is the identity there and the token gather returns the tokens."""
    from hsdp.parallel import SINGLE, Ulysses, cfg_combine

    sp = Ulysses(_C.ProcessGroup("single"))
    x = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)  # (B, n, H, D)
    heads = sp.heads(x, rec)
    assert heads.shape == (2, 4, 3, 5) and np.array_equal(heads, x.transpose(0, 2, 1, 3))
    assert np.array_equal(sp.tokens(heads, rec), x.reshape(2, 3, 20))
    assert np.array_equal(sp.gather_tokens(x, rec), x)
    guided = cfg_combine(SINGLE, lambda b: np.full(3, (2.0, 1.0)[b]), 3.0, rec)
    assert guided.dtype == np.float32 and guided.tolist() == [4.0] * 3  # 1 + 3 * (2 - 1)


def scenario_failed_load(rec, tmp_path):
    src = models.make_model("tiny", variant="quantized", seed=0)
    path = tmp_path / "cut.safetensors"
    hsdp.save_checkpoint(src, path)
    m = _meta(MarkedQuant)
    whole = [n for n, q in m.named_parameters() if q.ndim == 0 or not q.is_floating_point()]
    before = dict(rec.calls)
    with hsdp.checkpoint.open_checkpoint(path) as ck:
        # cut the file after every tensor kept whole, inside the sharded ones
        cut = max(ck[n].offset + ck[n].nbytes for n in whole)
        assert any(ck[n].offset + ck[n].nbytes > cut for n in ck)
        os.truncate(path, cut)
        with pytest.raises(OSError, match="file ends"):
            hsdp.load_model_sharded(m, ck, cfg(), "cpu", progress=False)
    assert rec.calls["assign"] - before.get("assign", 0) == len(whole)
    assert rec.calls["restore"] - before.get("restore", 0) == len(whole)
    params = dict(m.named_parameters())
    assert all(params[n].is_meta for n in whole)  # what was filled whole went back
    units = [mod._hsdp_unit for mod in m.modules() if getattr(mod, "_hsdp_unit", None)]
    assert [u.label for u in units] == [f"blocks.{i}" for i in range(TINY.num_layers)]
    assert all(u.broken for u in units)
    x, t_mod, ctx = (np.zeros(s, np.float32) for s in ((1, 4, 32), (1, 6, 32), (1, 2, 32)))
    with pytest.raises(RuntimeError, match="unusable: loading .* failed: OSError"):
        m.blocks[0](x, t_mod, ctx)
    with pytest.raises(RuntimeError):  # the root never became a unit: its parameters are still meta
        m(*INPUTS[0])


# ---- the tests


@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_forwards_through_adapter_match_numpy_path(rec, param_dtype, depth):
    """Sharded forwards bound in Python equal the plain NumPy path and the unsharded model, bit for bit."""
    scenario_forwards(rec, param_dtype, depth)
    assert {"cast_inputs", "bind", "unbind", "compute_dtype", "device_type"} <= set(rec.calls)


def test_output_dtype_through_adapter(rec):
    """output_dtype casts the root's output through the adapter exactly as the NumPy path does."""
    scenario_output_dtype(rec)
    assert rec.calls["cast_output"] > 0


def test_explicit_unshard_async_and_resident_through_adapter(rec):
    """unshard/reshard, async unshard and resident bind Python views of the unit's buffers and drop them."""
    scenario_explicit(rec)


def test_streaming_shard_through_adapter(rec):
    """prepare/shard_hsdp_module/finalize through the adapter give the shards of apply_hsdp_to_model."""
    scenario_streaming(rec)


def test_ignored_modules_move_through_adapter(rec):
    """Ignored modules are moved by the adapter and kept whole; outputs equal the NumPy path."""
    scenario_ignored(rec)
    assert rec.calls["move"] == 1


def test_load_model_sharded_through_adapter(rec, tmp_path):
    """load_model_sharded into a meta model the adapter owns equals the NumPy path and apply_hsdp_to_model."""
    scenario_load(rec, tmp_path)


def test_failed_load_restores_through_adapter(rec, tmp_path):
    """A checkpoint cut after validation fails the load; the adapter restores what it filled whole."""
    scenario_failed_load(rec, tmp_path)


def test_whole_api_through_adapter_covers_the_protocol(rec, tmp_path):
    """Running the whole API with the recording adapter calls every method of the TensorAdapter protocol."""
    assert PROTOCOL == {
        "owns", "named_parameters", "add_hooks", "move", "place_whole", "freeze", "dtype", "shape", "is_shardable",
        "is_sharded", "shard_source", "values", "assign", "restore", "held_nbytes", "mark_sharded",
        "compute_dtype", "check_device", "device_type", "cast_inputs", "cast_output", "bind", "unbind",
        "copy_state_dict", "unloaded", "named_buffers", "has_forward",
        "permute", "to_float32", "all_gather", "all_to_all",
    }
    scenario_forwards(rec, "bfloat16", 1)
    scenario_output_dtype(rec)
    scenario_explicit(rec)
    scenario_streaming(rec)
    scenario_ignored(rec)
    scenario_load(rec, tmp_path)
    scenario_failed_load(rec, tmp_path)
    scenario_exchanges(rec)
    missing = PROTOCOL - set(rec.calls)
    assert not missing, f"protocol methods the API never called: {sorted(missing)}"


def test_adapter_registry_order_and_removal():
    """register_adapter puts an adapter first; unregister removes it; the NumPy adapter cannot be removed."""
    a = RecordingAdapter()
    m, p = MarkedDiT(TINY), models.VideoDiT(TINY)
    assert adapters.adapter_for(m) is adapters.NUMPY  # a Marked model is still an nn.Module
    adapters.register_adapter(a)
    try:
        assert adapters.adapter_for(m) is a and adapters.adapter_for(p) is adapters.NUMPY
        adapters.register_adapter(a)  # again: still once, still first
        assert registry._adapters.count(a) == 1 and registry._adapters[0] is a
    finally:
        adapters.unregister_adapter(a)
    assert adapters.adapter_for(m) is adapters.NUMPY
    with pytest.raises(ValueError, match="cannot be removed"):
        adapters.unregister_adapter(adapters.NUMPY)
    with pytest.raises(TypeError, match="or an hsdp.nn.Module, got builtins.int"):
        adapters.adapter_for(3)


def test_numpy_path_binds_in_c(monkeypatch):
    """The plain NumPy path (bind_attr='_data') never calls the adapter's bind or unbind: the C unit binds."""
    calls = []
    monkeypatch.setattr(adapters.NUMPY, "bind", lambda st: calls.append(("bind", st.label)))
    monkeypatch.setattr(adapters.NUMPY, "unbind", lambda st: calls.append(("unbind", st.label)))
    assert adapters.NUMPY.bind_attr == "_data"
    model = plain()
    hsdp.apply_hsdp_to_model(model, cfg(prefetch_depth=2))
    for x in INPUTS * 2:
        model(*x)
    hsdp.unshard(model.blocks[1])
    unit = model.blocks[1]._hsdp_unit
    check_bound(model, [unit])
    # C views: their base is one leased export of the _Buffer (a memoryview), returned when they go
    assert all(isinstance(q._data.base, memoryview) and buffer_behind(q._data) is q._data.base.obj
               for q in unit.params)
    assert all(q._data.base.obj.leases == 1 for q in unit.params)  # one export per buffer, shared
    hsdp.reshard(model.blocks[1])
    hsdp.unshard(model, recurse=True, async_op=True).wait()
    hsdp.reshard(model, recurse=True)
    with hsdp.resident(model):
        model(*INPUTS[0])
    assert no_views(model)
    assert calls == []


# =========================================================================== 4. the source list


def parse_make_lists(text: str) -> dict[str, list[str]]:
    """`NAME := a b \\` lines (continued with a backslash) of a make fragment; comments dropped."""
    lists: dict[str, list[str]] = {}
    lines = iter(text.splitlines())
    for line in lines:
        line = line.split("#", 1)[0]
        if ":=" not in line:
            continue
        name, _, value = line.partition(":=")
        words = []
        while value.rstrip().endswith("\\"):
            words += value.rstrip()[:-1].split()
            value = next(lines).split("#", 1)[0]
        words += value.split()
        lists[name.strip()] = words
    return lists


def test_sources_mk_lists_every_c_file_once():
    """csrc/sources.mk names each csrc/*.c in CORE_SRC or (the test-only backends) TEST_SRC, and each
    csrc/py/*.c and csrc/py_<backend>/*.c in WRAP_SRC, exactly once."""
    lists = parse_make_lists((ROOT / "csrc" / "sources.mk").read_text())
    assert set(lists) == {"CORE_SRC", "WRAP_SRC", "TEST_SRC"}
    assert lists["TEST_SRC"] == ["csrc/backend_fakedev.c"]
    core, wrap = lists["CORE_SRC"] + lists["TEST_SRC"], lists["WRAP_SRC"]
    for name, files in lists.items():
        dupes = [f for f, k in Counter(files).items() if k > 1]
        assert not dupes, f"{name} lists {dupes} twice"
    assert not set(core) & set(wrap)
    assert not [f for f in core if f.startswith("csrc/py")] and all(f.startswith("csrc/py") for f in wrap)
    on_disk_core = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.c"))
    on_disk_wrap = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("py*/*.c"))
    assert sorted(core) == on_disk_core
    assert sorted(wrap) == on_disk_wrap


def _setup_functions() -> dict:
    """setup.py's sources() and variant(), defined without running setup()."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    keep = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("sources", "variant")]
    assert {n.name for n in keep} == {"sources", "variant"}
    ns = {"Path": Path, "HERE": ROOT}
    exec(compile(ast.Module(body=[ast.parse("from __future__ import annotations").body[0], *keep], type_ignores=[]),
                 "setup.py", "exec"), ns)
    return ns


def test_setup_and_makefile_read_the_same_list():
    """setup.py's sources() parses sources.mk as this test does, and the Makefile includes it."""
    ns = _setup_functions()
    mk = ROOT / "csrc" / "sources.mk"
    assert ns["sources"](mk) == parse_make_lists(mk.read_text())
    assert ns["variant"](["-O2", "-DHSDP_HAVE_MPI", "-I/usr/include"]) == "mpi"
    assert ns["variant"](["-O2"]) == "nompi" and ns["variant"]([]) == "nompi"
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^include csrc/sources\.mk$", makefile, re.M)
    setup_src = (ROOT / "setup.py").read_text()
    assert 'sources=[*SRC["CORE_SRC"], *SRC["WRAP_SRC"], *(SRC["TEST_SRC"] if TESTS else [])]' in setup_src
    assert ns["variant"](["-DHSDP_HAVE_MPI", "-DHSDP_TEST_BACKENDS"]) == "mpi-tests"


def test_empty_converting_slot_is_a_view_of_the_gathered_buffer():
    """A 0-element parameter whose compute dtype differs needs no conversion (it used to crash)."""
    p = Plain()
    u = _C.Unit(group(), ["bfloat16", "bfloat16"], [(0,), (3,)], params=(p, Plain()), compute_dtypes=["float32"] * 2,
                bind_attr="_data")
    assert u.view_specs[0][0] == 0 and u.view_specs[1][0] == 1
    u.unshard()
    assert p._data.shape == (0,) and p._data.dtype == np.float32
    u.reshard()
    only_empty = _C.Unit(group(), ["bfloat16"], [(0,)], params=(Plain(),), compute_dtypes=["float32"], bind_attr="_data")
    assert only_empty.widened_bytes == 0
    only_empty.unshard()
    only_empty.reshard()


def test_failed_adapter_bind_leaves_no_view_and_binds_next_time():
    """A bind that raises unbinds what it did; the next forward binds again, even if the unit stayed unsharded."""
    fails = {"n": 1}

    class Flaky(adapters.NumpyAdapter):
        bind_attr = None

        def owns(self, module):
            return isinstance(module, models.VideoDiT) and getattr(module, "_flaky", False)

        def bind(self, state):
            super().bind(state)
            if fails["n"] and state.fqn == "blocks.0":
                fails["n"] -= 1
                raise RuntimeError("bind failed on purpose")

    a = Flaky()
    adapters.register_adapter(a)
    try:
        m = models.make_model("tiny", seed=0)
        m._flaky = True
        hsdp.apply_hsdp_to_model(m, hsdp.HSDPInferenceConfig(enabled=True, reshard_after_forward=False))
        x = models.make_inputs(TINY, seed=0)
        with pytest.raises(RuntimeError, match="bind failed on purpose"):
            m(*x)
        assert all(q._data is None for q in m.blocks[0].parameters())
        ref = models.make_model("tiny", seed=0)
        hsdp.apply_hsdp_to_model(ref, hsdp.HSDPInferenceConfig(enabled=True, reshard_after_forward=False))
        assert np.array_equal(m(*x), ref(*x))
    finally:
        adapters.unregister_adapter(a)


def test_all_to_all_blocks_packs_strided_layouts_and_checks_them():
    """all_to_all_blocks on a world of one (backend.c packs host memory around all_to_all):
    a strided send lands contiguous; layouts reaching outside an array, or blocks of different
    sizes, are refused naming the bytes."""
    g = _C.ProcessGroup("single")
    src = np.arange(24, dtype=np.int32).reshape(4, 6)  # rows of 6 ints; the block is the first 3 of each row
    out = np.zeros(12, np.int32)
    g.all_to_all_blocks(src, (12, 48, ((4, 24),)), out, (48, 48, ()))  # one block: 4 rows of 12 bytes, 24 apart
    assert out.tolist() == src[:, :3].ravel().tolist()
    shifted = np.zeros_like(out)
    g.all_to_all_blocks(src[:, :].copy(), (8, 48, ((4, 24),)), shifted[:8], (32, 32, ()))
    assert shifted[:8].tolist() == src[:, :2].ravel().tolist()
    with pytest.raises(ValueError, match="the layouts reach 96 bytes of send"):
        g.all_to_all_blocks(src, (12, 48, ((8, 12),)), out, (96, 96, ()))
    with pytest.raises(ValueError, match="sends blocks of 48 bytes but receives blocks of 40"):
        g.all_to_all_blocks(src, (12, 48, ((4, 24),)), out, (40, 40, ()))
    with pytest.raises(ValueError, match="at most 3"):
        g.all_to_all_blocks(src, (4, 4, ((1, 1),) * 4), out, (4, 4, ()))
