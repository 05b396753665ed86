"""Sharding stock diffusers (torch) models: parity with the unsharded model bit for bit, in
float32 and in bfloat16 against a copy cast to the dtypes hsdp stores; parameter identity,
placeholders and hooks; one process here, real MPI ranks on the meshes 1x2, 2x2 and 1x4 in
tests/torch_worker.py."""

from __future__ import annotations

import gc
import re
import subprocess
import sys

import pytest
import torch

import hsdp
from hsdp.world.distributed import init_process_group
from mpirun import FAKEDEV, run_ranks
from torch_models import MODELS, is_linear, is_time_embedder, is_wan_block, make_wan, reference, run, wan_inputs

init_process_group("single")


@pytest.fixture(autouse=True)
def _clean():
    yield
    gc.collect()
    hsdp.empty_pool()


def sharded(kind: str, **kw):
    make, _, cond = MODELS[kind]
    model = make(0)
    model._hsdp_shard_conditions = [cond]
    kw.setdefault("enabled", True)
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(**kw))
    return model


@pytest.mark.parametrize("kind", ["wan", "flux"])
@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_parity_with_the_unsharded_model(kind, param_dtype, depth):
    """Every forward equals the unsharded reference bit for bit, prefetching or not."""
    model = sharded(kind, param_dtype=param_dtype, prefetch_depth=depth)
    expect = run(reference(kind, param_dtype), kind)
    assert expect.dtype == (torch.float32 if param_dtype == "float32" else torch.bfloat16)
    for _ in range(3):
        got = run(model, kind)
        assert got.dtype == expect.dtype and torch.equal(got, expect)


@pytest.mark.parametrize("meshes", [[(1, 2)], [(2, 2), (1, 4)]], ids=["1x2", "2x2+1x4"])
def test_parity_across_ranks(tmp_path, meshes):
    """On real MPI ranks, every mesh of a world size in one launch (a launch of its own per
    mesh would cost its start): Wan and Flux, float32 and bfloat16, equal the unsharded model;
    a save_pretrained folder streamed in on 1x2 and 2x2, where each rank reads only its own
    bytes and the streamed model is exact; and on 1x2, Wan with units inside its
    _keep_in_fp32_modules, and a bfloat16 Wan with the float8 wire against without it
    (tests/test_wire.py says what that checks)."""
    folder = _save(tmp_path, "20KB")
    n = meshes[0][0] * meshes[0][1]
    specs: list[str] = []
    for r, s in meshes:
        assert r * s == n
        specs += [f"mesh={r}x{s}", "wan:float32", "wan:bfloat16", "flux:float32", "flux:bfloat16"]
        if (r, s) in ((1, 2), (2, 2)):  # streaming load: 2 ranks, and replicas of a 2-rank shard group
            specs.append(f"load={folder}:bfloat16")
        if (r, s) == (1, 2):  # units inside diffusers' _keep_in_fp32_modules (float32 in a bfloat16 model)
            specs += ["wan-kept:bfloat16", "wire"]
    out = run_ranks(n, "tests/torch_worker.py", *map(str, meshes[0]), *specs, timeout=300).stdout
    for r, s in meshes:
        for kind in ("wan", "flux"):
            for dtype in ("float32", "bfloat16"):
                assert out.count(f"ok {kind} {dtype} {r}x{s} on mpi") == n, out
    assert out.count("ok load bfloat16 1x2 read") == (2 if n == 2 else 0), out
    assert out.count("ok load bfloat16 2x2 read") == (4 if n == 4 else 0), out
    assert out.count("ok wan-kept bfloat16 1x2 on mpi") == (2 if n == 2 else 0), out
    assert out.count("ok wire") == (2 if n == 2 else 0), out
    assert out.count("ok") == n * (len(specs) - len(meshes)), out


def test_parity_on_the_fake_device():
    """On the test-only fakedev backend (tests/mpirun.py FAKEDEV) with the target device its
    device_info names: every unit's buffers are the fake device's, exported over DLPack, and
    Wan still equals the unsharded model bit for bit; then, in the same launch, HSDP x
    Ulysses with the exchanges on device addresses (all_to_all_device), within the tolerance
    it has on MPI (the stock Flux on device buffers runs through the NCCL backend over the
    fake CUDA library: tests/test_nccl.py)."""
    out = run_ranks(2, "tests/torch_worker.py", "1", "2", "wan:float32", "ulysses:float32", env=FAKEDEV,
                    timeout=300).stdout
    assert out.count("ok wan float32 1x2 on fakedev") == 2, out
    assert out.count("torch ulysses float32 ok on fakedev") == 2, out


def test_parameters_keep_identity_and_become_placeholders():
    """The same nn.Parameter objects stay; outside a forward each is a 0-element tensor of its
    storage dtype, with its shape kept; inside its unit's forward a view of the gather."""
    model = make_wan(0)
    model._hsdp_shard_conditions = [is_wan_block]
    before = list(model.named_parameters())
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True))
    assert [(n, id(p)) for n, p in model.named_parameters()] == [(n, id(p)) for n, p in before]
    q = model.blocks[0].attn1.to_q.weight
    assert q.numel() == 0 and q.dtype == torch.bfloat16 and q._hsdp_shape == (32, 32)
    assert not q.requires_grad
    seen = {}
    handle = model.blocks[0].attn1.to_q.register_forward_pre_hook(
        lambda m, a: seen.update(shape=tuple(m.weight.shape), ptr=m.weight.data_ptr()))
    run(model, "wan")
    handle.remove()
    unit = model.blocks[0]._hsdp_unit.unit
    assert seen["shape"] == (32, 32) and seen["ptr"] != 0
    assert q.numel() == 0 and not unit.holds_buffers


def test_keep_in_fp32_modules_are_honoured():
    """diffusers' _keep_in_fp32_modules keep float32 when param_dtype is bfloat16 (FSDP2 casts them)."""
    model = sharded("wan")
    keep = set(model._keep_in_fp32_modules)
    for n, p in model.named_parameters():
        want = torch.float32 if not keep.isdisjoint(n.split(".")) else torch.bfloat16
        assert p.dtype == want, n
    assert model.blocks[0].scale_shift_table.dtype == torch.float32
    assert model.blocks[0].ffn.net[2].weight.dtype == torch.bfloat16


def test_no_grad_and_inference_mode_and_no_allocation():
    """Forwards under no_grad and inference_mode agree; steady forwards allocate no buffer."""
    model = sharded("wan")
    args, kwargs = wan_inputs()
    with torch.no_grad():
        a = model(*args, **kwargs)[0]
    allocs = hsdp.memory_stats()["buffer_allocs"]
    with torch.inference_mode():
        b = model(*args, **kwargs)[0]
        c = model(*args, **kwargs)[0]
    assert torch.equal(a, b) and torch.equal(b, c)
    assert hsdp.memory_stats()["buffer_allocs"] == allocs
    assert not any(p.is_inference() for p in model.parameters())


def test_exception_in_a_forward_still_reshards():
    """The post-hook runs with always_call: a block that raises leaves nothing unsharded."""
    model = sharded("wan")
    run(model, "wan")

    def boom(module, args):
        raise KeyError("boom")

    h = model.blocks[1].attn1.register_forward_pre_hook(boom)
    with pytest.raises(KeyError, match="boom"):
        run(model, "wan")
    h.remove()
    assert not any(u.unit.holds_buffers for u in hsdp.get_units(model))
    assert torch.equal(run(model, "wan"), run(reference("wan", "bfloat16"), "wan"))


def test_explicit_unshard_resident_and_full_state_dict():
    """unshard/reshard, resident and full_state_dict work on torch models as on hsdp.nn."""
    model = sharded("wan", param_dtype="float32")
    ref = reference("wan", "float32")
    hsdp.unshard(model.blocks[0])
    assert torch.equal(model.blocks[0].ffn.net[0].proj.weight, ref.blocks[0].ffn.net[0].proj.weight)
    hsdp.reshard(model.blocks[0])
    assert model.blocks[0].ffn.net[0].proj.weight.numel() == 0
    with hsdp.resident(model):
        gathers = hsdp.memory_stats()["gathers"]
        assert torch.equal(run(model, "wan"), run(ref, "wan"))
        assert hsdp.memory_stats()["gathers"] == gathers
    full = hsdp.full_state_dict(model)
    assert set(full) == set(ref.state_dict())
    assert all(torch.equal(full[k], v) for k, v in ref.state_dict().items())
    assert not any(u.unit.holds_buffers for u in hsdp.get_units(model))


def test_conditions_on_the_class_and_a_model_without_conditions():
    """_hsdp_shard_conditions may be a class attribute; a stock model without them is an error naming its class."""
    from diffusers import WanTransformer3DModel

    class ShardedWan(WanTransformer3DModel):
        _hsdp_shard_conditions = [is_wan_block]

    torch.manual_seed(0)
    cfg = make_wan(0).config
    model = ShardedWan.from_config(cfg)
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True))
    assert len(hsdp.get_units(model)) == 4
    with pytest.raises(ValueError, match="WanTransformer3DModel declares no _hsdp_shard_conditions"):
        hsdp.apply_hsdp_to_model(make_wan(0), hsdp.HSDPInferenceConfig(enabled=True))


def test_gpu_target_device_on_a_cpu_world_is_refused():
    """target_device='cuda' on a world already running on a CPU backend: with no GPU, a
    RuntimeError saying so with the CUDA runtime's error (not advice to start NCCL, which
    would fail next); with one, a ValueError naming both backends. The model is untouched.
    (A fresh process: tests/test_nccl.py.)"""
    model = make_wan(0)
    model._hsdp_shard_conditions = [is_wan_block]
    world = hsdp.distributed.init_process_group()
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=f"needs the NCCL process group, but this one runs on '{world.backend}'"):
            hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True), target_device="cuda")
    else:
        with pytest.raises(RuntimeError, match=r"target_device 'cuda' needs a GPU: no usable GPU for the NCCL "
                                               r"backend: cudaGetDeviceCount failed with CUDA error \d+ \(") as e:
            hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True), target_device="cuda")
        assert type(e.value) is RuntimeError and world.backend == "single"
    assert model.blocks[0].attn1.to_q.weight.shape == (32, 32) and not hasattr(model.blocks[0], "_hsdp_unit")


@pytest.mark.parametrize("device", ["gpu", "tpu", 3.5])
def test_a_target_device_that_is_no_torch_device_is_a_value_error_naming_it(device):
    """The user guide's promise: a ValueError naming the value, before the process group or
    the model is touched (torch's own error would not say which argument it was)."""
    model = make_wan(0)
    model._hsdp_shard_conditions = [is_wan_block]
    with pytest.raises(ValueError, match=re.escape(f"target_device {device!r} is not")):
        hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True), target_device=device)
    assert model.blocks[0].attn1.to_q.weight.shape == (32, 32) and not hasattr(model.blocks[0], "_hsdp_unit")


@pytest.mark.parametrize("conditions", [[is_time_embedder, is_wan_block], [is_linear]], ids=["time_embedder", "linear"])
def test_units_inside_keep_in_fp32_modules_run_in_bfloat16(conditions):
    """A unit whose parameters are all kept in float32 (inside Wan's _keep_in_fp32_modules:
    the time embedder, or its nn.Linears) casts no inputs to bfloat16, as diffusers casts
    none for it, so its float32 weights get the float32 inputs Wan gives them; equal to the
    unsharded reference, which follows the same rule."""
    model = make_wan(0)
    model._hsdp_shard_conditions = conditions
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, param_dtype="bfloat16"))
    uncast = sorted(u.label for u in hsdp.get_units(model) if u._input_dtype is None)
    assert uncast == (["condition_embedder.time_embedder"] if is_time_embedder in conditions else
                      ["condition_embedder.time_embedder.linear_1", "condition_embedder.time_embedder.linear_2"])
    assert model.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32
    expect = run(reference("wan", "bfloat16", conditions=conditions), "wan")
    for _ in range(2):
        got = run(model, "wan")
        assert got.dtype == torch.bfloat16 and torch.equal(got, expect)
    if is_time_embedder in conditions:  # the time embedder's own unit changes no number
        assert torch.equal(got, run(reference("wan", "bfloat16"), "wan"))


def test_a_module_list_selected_as_a_unit_is_refused_naming_it():
    """A ModuleList is never called, so its hooks would never gather: refused at shard time,
    naming it and its children, before anything changes (also on the streaming path)."""
    model = make_wan(0)
    model._hsdp_shard_conditions = [lambda name, m: name == "blocks"]
    match = (r"'blocks' \(ModuleList\) cannot be an HSDP unit: it is never called.*"
             r"Select its children instead \(e\.g\. 'blocks\.0'\)")
    with pytest.raises(ValueError, match=match):
        hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True), target_device="cpu")
    with pytest.raises(ValueError, match=match):
        hsdp.prepare_hsdp_shard_context(model, hsdp.HSDPInferenceConfig(enabled=True))
    with pytest.raises(ValueError, match=match):
        hsdp.shard_model(model, hsdp_shard_conditions=model._hsdp_shard_conditions)
    assert model.blocks[0].attn1.to_q.weight.shape == (32, 32)
    assert all(getattr(m, "_hsdp_unit", None) is None and not m._forward_pre_hooks for m in model.modules())
    other = make_wan(0)
    other._hsdp_shard_conditions = [is_wan_block]
    ctx = hsdp.prepare_hsdp_shard_context(other, hsdp.HSDPInferenceConfig(enabled=True))
    with pytest.raises(ValueError, match=match):
        hsdp.shard_hsdp_module(other.blocks, ctx)
    assert not hasattr(other.blocks[0], "_hsdp_unit") and other.blocks[0].attn1.to_q.weight.shape == (32, 32)
    # with its children selected too, the list holds nothing of its own: no unit, no error
    model._hsdp_shard_conditions = [lambda name, m: name == "blocks" or is_wan_block(name, m)]
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True))
    assert [u.label for u in hsdp.get_units(model)] == ["blocks.0", "blocks.1", "blocks.2", "<root>"]
    assert torch.equal(run(model, "wan"), run(reference("wan", "bfloat16"), "wan"))


def test_import_hsdp_does_not_import_torch():
    """torch is optional: import hsdp (and sharding hsdp.nn models) never imports it."""
    code = "import sys, hsdp; from hsdp import models; hsdp.adapters.adapter_for(models.make_model('tiny')); " \
           "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def _save(tmp_path, shard_size=None):
    folder = tmp_path / "wan"
    kw = {"max_shard_size": shard_size} if shard_size else {}
    make_wan(0).save_pretrained(folder, **kw)
    return folder


def _empty_wan(folder):
    import accelerate
    from diffusers import WanTransformer3DModel

    with accelerate.init_empty_weights():
        model = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(folder)).eval()
    model._hsdp_shard_conditions = [is_wan_block]
    return model


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shard_size", [None, "20KB"])
def test_streaming_load_from_save_pretrained(tmp_path, param_dtype, shard_size):
    """A save_pretrained folder (one file, or a sharded index) streams into a model built under
    init_empty_weights, and the result equals the unsharded model bit for bit."""
    folder = _save(tmp_path, shard_size)
    assert (folder / "diffusion_pytorch_model.safetensors.index.json").exists() == bool(shard_size)
    model = _empty_wan(folder)
    assert model.blocks[0].attn1.to_q.weight.is_meta
    hsdp.load_model_sharded(model, folder, hsdp.HSDPInferenceConfig(enabled=True, param_dtype=param_dtype),
                            progress=False)
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    assert torch.equal(run(model, "wan"), run(reference("wan", param_dtype), "wan"))


def test_meta_buffers_left_after_loading_are_an_error_naming_them(tmp_path):
    """Under torch.device('meta') the RoPE buffers stay meta (FSDP2's route gives all-NaN
    outputs); hsdp names them and leaves the model plainly unusable."""
    from diffusers import WanTransformer3DModel

    folder = _save(tmp_path)
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(folder)).eval()
    model._hsdp_shard_conditions = [is_wan_block]
    with pytest.raises(RuntimeError, match=r"no values \(meta\): 'rope.freqs_cos', 'rope.freqs_sin'"):
        hsdp.load_model_sharded(model, folder, hsdp.HSDPInferenceConfig(enabled=True), progress=False)
    with pytest.raises(RuntimeError, match="unusable"):
        run(model, "wan")


def test_failed_load_leaves_the_model_as_it_was(tmp_path):
    """A checkpoint cut short is refused before any data is read: no unit made, the model still meta."""
    from hsdp.checkpoint import CheckpointError

    folder = _save(tmp_path)
    f = folder / "diffusion_pytorch_model.safetensors"
    data = f.read_bytes()
    model = _empty_wan(folder)
    f.write_bytes(data[: len(data) - 4096])
    with pytest.raises(CheckpointError, match="run past the end of the data section"):
        hsdp.load_model_sharded(model, folder, hsdp.HSDPInferenceConfig(enabled=True), progress=False)
    assert all(p.is_meta for p in model.parameters())
    assert not any(hasattr(m, "_hsdp_unit") for m in model.modules())


def test_buffer_dlpack_export_is_zero_copy_and_leases_the_buffer():
    """_Buffer.__dlpack__ (versioned and legacy) gives torch the gathered bytes themselves; each
    export is a lease, returned when torch's tensor dies (the DLPack deleter) or when an
    unconsumed capsule goes, so a viewed buffer is never pooled for reuse."""
    import numpy as np

    from hsdp import _C

    g = hsdp.init_device_mesh("cpu", (1, 1)).shard_group
    u = _C.Unit(g, ["bfloat16"], [(100,)])
    u.write(0, np.arange(100, dtype=np.float32))
    u.unshard()
    full, _ = u.buffers()
    assert full.leases == 0
    t = torch.from_dlpack(full)  # versioned capsule
    assert t.dtype == torch.uint8 and t.numel() == full.nbytes and t.data_ptr() == full.address
    assert torch.equal(t[:200].view(torch.bfloat16)[:5].float(), torch.arange(5.0))
    assert full.leases == 1
    legacy = torch.utils.dlpack.from_dlpack(full.__dlpack__())  # no max_version: the legacy capsule
    view = t[10:20]  # shares t's storage: no lease of its own
    assert legacy.data_ptr() == full.address and full.leases == 2
    unused = full.__dlpack__(max_version=(1, 0))
    assert full.leases == 3
    del t, legacy, unused
    assert full.leases == 1  # the view still holds the first export's storage
    mv = memoryview(full)  # the buffer protocol leases too, until released
    assert full.leases == 2
    mv.release()
    del view
    assert full.leases == 0
    # one export per parameter (what a torch bind imports): each view is a lease of its own
    spec = np.array([64, 4, 16, 2, 3, 2, 2, 1, 0, 2, 32, 1, 2, 1], dtype=np.int64).tobytes()
    a, b = (torch._C._from_dlpack(c) for c in _C.dlpack_views(full, spec, True))
    assert a.dtype == torch.bfloat16 and a.shape == (3, 2) and a.data_ptr() == full.address + 64
    assert torch.equal(a.float().flatten(), torch.arange(32.0, 38.0))
    assert b.dtype == torch.float32 and b.shape == (2,) and full.leases == 2
    del a
    assert full.leases == 1
    del b
    assert full.leases == 0
    with pytest.raises(ValueError, match="outside the 256-byte buffer"):
        _C.dlpack_views(full, np.array([250, 2, 32, 1, 2, 1], dtype=np.int64).tobytes(), True)
    with pytest.raises(ValueError, match="truncated"):
        _C.dlpack_views(full, np.array([0, 2, 32, 2, 1], dtype=np.int64).tobytes(), True)
    assert full.leases == 0
    assert full.__dlpack_device__() == (1, 0)
    with pytest.raises(BufferError, match="without a copy"):
        full.__dlpack__(copy=True)
    del full
    u.reshard()



class _Block(torch.nn.Linear):
    def forward(self, x):  # a float8 weight is computed with in the input's dtype
        w = self.weight
        return torch.nn.functional.linear(x, w.to(x.dtype) if w.dtype == torch.float8_e4m3fn else w, self.bias)


class _Mixed(torch.nn.Module):
    """Blocks, plus what hsdp keeps whole: an ignored module, a 0-d scale and an integer table."""

    _hsdp_shard_conditions = [lambda n, m: n.startswith("blocks.") and n.count(".") == 1]
    _hsdp_ignored_modules = ["embed"]

    def __init__(self, fp8: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(8, 8)
        self.blocks = torch.nn.ModuleList(_Block(8, 8) for _ in range(2))
        self.scale = torch.nn.Parameter(torch.tensor(0.5))
        self.table = torch.nn.Parameter(torch.arange(8, dtype=torch.int32), requires_grad=False)
        if fp8:
            self.blocks[1].weight.data = self.blocks[1].weight.data.to(torch.float8_e4m3fn)

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return x * self.scale + self.table.to(x.dtype)


def test_kept_whole_parameters_ignored_modules_and_torch_dtypes():
    """As on the NumPy runtime: ignored modules and 0-d / integer parameters stay whole on
    target_device; config dtypes accept torch dtypes; the output equals the unsharded model."""
    ref, model = _Mixed(), _Mixed()
    with pytest.raises(ValueError, match="target_device is None"):
        hsdp.apply_hsdp_to_model(_Mixed(), hsdp.HSDPInferenceConfig(enabled=True))
    cfg = hsdp.HSDPInferenceConfig(enabled=True, param_dtype=torch.float32)
    assert cfg.param_dtype == "float32"
    hsdp.apply_hsdp_to_model(model, cfg, target_device="cpu")
    assert model.embed.weight.shape == (8, 8) and getattr(model.embed.weight, "_hsdp_state", None) is None
    assert model.scale.ndim == 0 and model.table.dtype == torch.int32 and model.table.numel() == 8
    assert model.blocks[0].weight.numel() == 0  # sharded: a placeholder outside the forward
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def test_fp8_parameters_keep_their_dtype():
    """A model holding float8 parameters keeps every parameter's own dtype (no param_dtype cast)."""
    ref, model = _Mixed(fp8=True), _Mixed(fp8=True)
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True), target_device="cpu")
    assert model.blocks[1].weight.dtype == torch.float8_e4m3fn and model.blocks[0].weight.dtype == torch.float32
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def test_state_dict_of_a_sharded_model_is_refused_not_empty(tmp_path):
    """model.state_dict() / save_pretrained on a sharded model would write 0-element
    placeholders: refused, naming the unit; full_state_dict and resident work."""
    model = sharded("wan", param_dtype="float32")
    with pytest.raises(RuntimeError, match=r"sharded by hsdp \(unit '.*'\); use hsdp.full_state_dict"):
        model.state_dict()
    with pytest.raises(RuntimeError, match="full_state_dict"):
        model.save_pretrained(tmp_path / "never")
    with hsdp.resident(model):
        sd = model.state_dict()
    assert all(v.numel() > 0 for k, v in sd.items() if not k.startswith("rope"))
    assert set(hsdp.full_state_dict(model)) == set(sd)


def test_resident_under_inference_mode_leaves_normal_parameters():
    """Views bound inside inference_mode are normal tensors: after a resident loop under
    inference_mode, a no_grad (or grad-mode) forward of the same resident model still runs."""
    model = sharded("wan", param_dtype="float32")
    args, kwargs = wan_inputs()
    with hsdp.resident(model):
        with torch.inference_mode():
            a = model(*args, **kwargs)[0]
        assert not any(p.is_inference() for p in model.parameters())
        x = args[0].clone().requires_grad_(True)
        b = model(x, *args[1:], **kwargs)[0]
        b.sum().backward()  # grads flow to the input through the gathered views
    assert torch.equal(a, b.detach()) and x.grad is not None


def test_model_built_in_inference_mode_shards_and_runs():
    """A model whose parameters are inference tensors (built under inference_mode) still shards."""
    with torch.inference_mode():
        model = make_wan(0)
    model._hsdp_shard_conditions = [is_wan_block]
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, param_dtype="float32"))
    with torch.no_grad():
        assert torch.equal(run(model, "wan"), run(reference("wan", "float32"), "wan"))


def test_streaming_load_with_ignored_modules(tmp_path):
    """An ignored module of an empty (meta) model is filled whole by the loader, not moved as meta."""
    src = _Mixed()
    folder = tmp_path / "mixed"
    folder.mkdir()
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, folder / "model.safetensors")
    import accelerate

    with accelerate.init_empty_weights():
        empty = _Mixed()
    hsdp.load_model_sharded(empty, folder, hsdp.HSDPInferenceConfig(enabled=True, param_dtype="float32"),
                            target_device="cpu", progress=False)
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(empty(x), src(x))


def test_keep_in_fp32_modules_are_float32_even_on_a_bfloat16_model():
    """As diffusers loads them: the kept modules are float32 whatever the model was cast to."""
    model = make_wan(0).to(torch.bfloat16)
    model._hsdp_shard_conditions = [is_wan_block]
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True))
    assert model.blocks[0].scale_shift_table.dtype == torch.float32
    assert model.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32
    assert model.blocks[0].ffn.net[2].weight.dtype == torch.bfloat16


def test_dlpack_refuses_another_device():
    """A consumer that asks for another DLPack device gets BufferError (no copy is made)."""
    import numpy as np

    from hsdp import _C

    u = _C.Unit(hsdp.init_device_mesh("cpu", (1, 1)).shard_group, ["float32"], [(4,)])
    u.write(0, np.arange(4, dtype=np.float32))
    u.unshard()
    full, _ = u.buffers()
    assert full.__dlpack__(dl_device=(1, 0)) is not None
    with pytest.raises(BufferError, match=r"lives on DLPack device \(1, 0\), not \(2, 0\)"):
        full.__dlpack__(dl_device=(2, 0))
    del full
    u.reshard()


class _WithBuffer(_Mixed):
    """_Mixed plus a persistent buffer (a learned-position table, as SD3 and CogVideoX have)
    that checkpoints hold, and a non-persistent one that they do not."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pos", torch.linspace(0, 1, 8))
        self.register_buffer("cache", torch.ones(8), persistent=False)

    def forward(self, x):
        return super().forward(x + self.pos) * self.cache


def test_persistent_buffers_stream_in_whole(tmp_path):
    """A checkpoint's persistent buffers load whole on every rank (they used to be 'unexpected')."""
    import accelerate
    from safetensors.torch import save_file

    src = _WithBuffer()
    folder = tmp_path / "buf"
    folder.mkdir()
    state = src.state_dict()
    assert "pos" in state and "cache" not in state
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors")
    with accelerate.init_empty_weights():  # buffers real, parameters meta
        empty = _WithBuffer()
    empty.pos.data = torch.zeros(8)  # what the checkpoint must overwrite
    hsdp.load_model_sharded(empty, folder, hsdp.HSDPInferenceConfig(enabled=True, param_dtype="float32"),
                            target_device="cpu", progress=False)
    assert torch.equal(empty.pos, src.pos)
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(empty(x), src(x))


def test_steady_forwards_return_every_lease_and_allocate_nothing():
    """After warm-up a forward allocates no buffer: each bind's DLPack import is a lease that
    torch returns at unbind, so every buffer goes back to the pool ([Note: leases])."""
    model = sharded("wan", param_dtype="float32")
    expect = run(reference("wan", "float32"), "wan")
    for _ in range(3):
        assert torch.equal(run(model, "wan"), expect)
    before = hsdp.memory_stats()["buffer_allocs"]
    for _ in range(2):
        assert torch.equal(run(model, "wan"), expect)
    assert hsdp.memory_stats()["buffer_allocs"] == before
    assert hsdp.memory_stats()["unsharded_bytes"] == 0  # every buffer is back: none out on a lease


def test_a_view_a_user_keeps_keeps_its_bytes():
    """A weight kept from inside a forward stays correct: its buffer leaves the pool with it
    instead of being regathered for another block under it."""
    model = sharded("wan", param_dtype="float32")
    whole = dict(make_wan(0).named_parameters())
    run(model, "wan")
    run(model, "wan")  # the pool holds buffers with views kept
    kept = []
    h = model.blocks[0].attn1.to_q.register_forward_hook(lambda m, a, o: kept.append(m.weight.detach()))
    run(model, "wan")
    h.remove()
    for _ in range(2):
        run(model, "wan")
    assert torch.equal(kept[0], whole["blocks.0.attn1.to_q.weight"])
    assert hsdp.memory_stats()["unsharded_bytes"] > 0  # out on the user's lease, not in the pool
    del kept
    assert hsdp.memory_stats()["unsharded_bytes"] == 0  # the lease came back: the buffer is freed


def test_emptying_the_pool_frees_every_pooled_buffer():
    """No view of a pooled buffer is left behind to keep it alive once the pool lets go: no
    buffer outlives the model and the pool."""
    model = sharded("wan", param_dtype="float32")
    for _ in range(3):
        run(model, "wan")
    assert hsdp.memory_stats()["pooled_bytes"] > 0
    hsdp.empty_pool()
    stats = hsdp.memory_stats()
    # a buffer kept alive by its own views would still count as unsharded bytes
    assert stats["pooled_bytes"] == 0 and stats["unsharded_bytes"] == 0, stats
    assert torch.equal(run(model, "wan"), run(reference("wan", "float32"), "wan"))


def test_a_meta_parameter_with_a_weak_reference_is_refused_before_anything_changes():
    """torch cannot swap data into a weakly referenced meta tensor: the unit says so, names
    the parameter, and the units sharded before it refuse every use."""
    import weakref

    import accelerate

    with accelerate.init_empty_weights():
        model = make_wan(0)
    model._hsdp_shard_conditions = [is_wan_block]
    target = model.blocks[1].attn1.to_k.weight
    ref = weakref.ref(target)
    with pytest.raises(RuntimeError, match="weak reference"):
        hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True))
    assert ref() is target and target.is_meta  # untouched
    assert model.blocks[1].attn1.to_k.weight is target
    # units are committed in post order: block 0 was sharded before block 1 failed
    assert "sharding stopped at unit 'blocks.1'" in model.blocks[0]._hsdp_unit.broken
    with pytest.raises(RuntimeError, match="unusable"):
        model.blocks[0](*[torch.zeros(1)] * 4)


def test_a_parameter_tied_across_two_units_is_refused_naming_both():
    """Tied weights across blocks: an error at sharding naming the parameter and both units,
    before anything changes, instead of the second block silently losing its unit."""
    model = make_wan(0)
    model._hsdp_shard_conditions = [is_wan_block]
    shared = model.blocks[0].attn1.to_q.weight
    model.blocks[2].attn1.to_q.weight = shared
    with pytest.raises(ValueError, match=r"'blocks.2.attn1.to_q.weight' is the same Parameter as "
                                         r"'blocks.0.attn1.to_q.weight', which unit 'blocks.0' already holds"):
        hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True))
    assert shared.numel() > 0 and not hasattr(shared, "_hsdp_state")  # nothing sharded
    assert all(getattr(m, "_hsdp_unit", None) is None for m in model.modules())


def test_a_sharded_parameter_replaced_after_sharding_fails_the_next_forward_naming_it():
    model = sharded("wan", param_dtype="float32")
    run(model, "wan")
    old = model.blocks[1].attn1.to_q.weight
    model.blocks[1].attn1.to_q.weight = torch.nn.Parameter(torch.zeros(old._hsdp_shape))
    with pytest.raises(RuntimeError, match=r"unusable: parameter 'blocks.1.attn1.to_q.weight' was replaced"):
        run(model, "wan")


def test_residency_budget_keeps_wan_outputs_bit_equal():
    """A torch Wan with a budget of half its blocks: every forward equals the budget-free
    run bit for bit, and the steady forwards gather only the units not kept."""
    free = sharded("wan")
    expect = run(free, "wan")  # every forward of the budget-free model gives this (test_parity_...)
    budget = sum(u.full_bytes for u in hsdp.get_units(free) if not u.is_root) // 2
    n_units = len(hsdp.get_units(free))
    del free
    gc.collect()
    model = sharded("wan", resident_bytes=budget)
    for i in range(3):
        before = hsdp.memory_stats()["gathers"]
        assert torch.equal(run(model, "wan"), expect), i
    stats = hsdp.residency_stats(model)
    assert 0 < len(stats["resident_units"]) < n_units
    assert hsdp.memory_stats()["gathers"] - before == n_units - len(stats["resident_units"])
    assert 0.3 * budget <= hsdp.memory_stats()["unsharded_bytes"] <= budget
