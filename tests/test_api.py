"""The specified API in one process (a world of one): behaviour, dtype policy, every error
case of design section 4, and that a failed call leaves the model exactly as it was."""

from __future__ import annotations

import gc
import logging
import re

import numpy as np
import pytest

import hsdp
from hsdp import models, nn
from hsdp.world.distributed import init_process_group

init_process_group("single")

TINY = models.DiTConfig.preset("tiny")


def cfg(**kw):
    kw.setdefault("enabled", True)
    return hsdp.HSDPInferenceConfig(**kw)


def snapshot(model):
    """Everything an error must leave untouched."""
    return {
        "params": {n: (p, p.dtype, p.data.copy(), p.requires_grad) for n, p in model.named_parameters()},
        "hooks": [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()],
        "units": [getattr(m, "_hsdp_unit", None) for m in model.modules()],
    }


def assert_unchanged(model, snap):
    for n, p in model.named_parameters():
        obj, dtype, data, rg = snap["params"][n]
        assert p is obj and p.dtype == dtype and p.requires_grad == rg, n
        assert np.array_equal(p.data, data), n
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()] == snap["hooks"]
    assert [getattr(m, "_hsdp_unit", None) for m in model.modules()] == snap["units"]


@pytest.fixture(autouse=True)
def _collect():
    yield
    gc.collect()


# --------------------------------------------------------------------------- config


def test_config_defaults_and_repr():
    c = hsdp.HSDPInferenceConfig()
    assert (c.enabled, c.hsdp_replicate_size, c.hsdp_shard_size) == (False, 1, -1)
    assert (c.param_dtype, c.reduce_dtype, c.output_dtype, c.reshard_after_forward) == (
        "bfloat16", "float32", None, True)
    assert repr(c) == (
        "HSDPInferenceConfig(enabled=False, hsdp_replicate_size=1, hsdp_shard_size=-1, "
        "param_dtype='bfloat16', reduce_dtype='float32', output_dtype=None, reshard_after_forward=True, "
        "prefetch_depth=1, max_unsharded_bytes=None, wire_dtype=None, resident_bytes=None)"
    )


def test_config_dtypes_and_equality():
    a = hsdp.HSDPInferenceConfig(enabled=True, param_dtype=np.float16, output_dtype="fp32")
    b = hsdp.HSDPInferenceConfig(enabled=True, param_dtype="float16", output_dtype=hsdp.float32)
    assert a == b and a.param_dtype == hsdp.float16
    assert a != hsdp.HSDPInferenceConfig(enabled=True)
    b.param_dtype = None
    assert b.param_dtype is None and a != b

    class FakeTorchDtype:  # what torch.bfloat16 looks like to hsdp, without importing torch
        def __str__(self):
            return "torch.bfloat16"

    FakeTorchDtype.__module__ = "torch"
    FakeTorchDtype.__name__ = "dtype"
    assert hsdp.HSDPInferenceConfig(param_dtype=FakeTorchDtype()).param_dtype == "bfloat16"
    with pytest.raises(TypeError):
        hash(a)


@pytest.mark.parametrize(
    "kw,exc,words",
    [
        ({"hsdp_replicate_size": 0}, ValueError, ["hsdp_replicate_size", "0"]),
        ({"hsdp_shard_size": -2}, ValueError, ["hsdp_shard_size", "-2"]),
        ({"hsdp_shard_size": 0}, ValueError, ["hsdp_shard_size", "0"]),
        ({"param_dtype": "int8"}, ValueError, ["param_dtype", "int8"]),
        ({"param_dtype": "bfloat17"}, TypeError, ["param_dtype", "bfloat17"]),
        ({"output_dtype": "int32"}, ValueError, ["output_dtype", "int32"]),
    ],
)
def test_config_bad_values(kw, exc, words):
    with pytest.raises(exc) as ei:
        hsdp.HSDPInferenceConfig(**kw)
    for w in words:
        assert w in str(ei.value)


def test_config_setters_validate():
    c = hsdp.HSDPInferenceConfig()
    with pytest.raises(ValueError, match="hsdp_replicate_size"):
        c.hsdp_replicate_size = 0
    with pytest.raises(TypeError):
        c.hsdp_shard_size = 2.5
    c.hsdp_shard_size = 4
    assert c.hsdp_shard_size == 4


def test_policy_validates():
    assert hsdp.MixedPrecisionPolicy(param_dtype="bf16").param_dtype == hsdp.bfloat16
    with pytest.raises(ValueError, match="int8"):
        hsdp.MixedPrecisionPolicy(param_dtype="int8")


# --------------------------------------------------------------------------- process group, mesh


def test_process_group_and_mesh():
    w = init_process_group()
    assert (w.backend, w.rank, w.size) == ("single", 0, 1)
    assert init_process_group("single") is w
    with pytest.raises(RuntimeError, match="already initialised"):
        init_process_group("mpi")
    with pytest.raises(ValueError, match="'tcp'"):
        init_process_group("tcp")
    m = hsdp.init_device_mesh("cpu", (1, 1))
    assert m is hsdp.init_device_mesh("cpu", (1, 1))
    assert m.size() == 1 and m.get_group("shard").size == 1 and m.get_local_rank("replicate") == 0
    with pytest.raises(ValueError, match=r"\(1, 2\).*world size is 1"):
        hsdp.init_device_mesh("cpu", (1, 2))
    # no GPU here: RuntimeError, as torch raises; NCCL not built or installed: NotImplementedError
    reason = hsdp.distributed.backend_reason("nccl")
    no_gpu = reason is not None and reason.startswith("no usable GPU for the NCCL backend")
    with pytest.raises(RuntimeError if no_gpu else NotImplementedError, match="NCCL"):
        hsdp.init_device_mesh("cuda", (1, 1))
    with pytest.raises(NotImplementedError, match="NCCL"):
        hsdp._C.ProcessGroup("nccl")


# --------------------------------------------------------------------------- apply: behaviour


def test_apply_logs_and_freezes(caplog):
    model = models.make_model("tiny", seed=0)
    with caplog.at_level(logging.INFO, logger="hsdp"):
        hsdp.apply_hsdp_to_model(model, cfg())
    text = caplog.text
    assert "HSDP setup: replicate_size=1 shard_size=1 world_size=1 rank=0" in text
    assert f"Sharded {TINY.num_layers} modules + root" in text
    assert "HSDP applied to model: VideoDiT" in text
    assert not any(p.requires_grad for p in model.parameters())
    assert [u.fqn for u in hsdp.get_units(model)] == [f"blocks.{i}" for i in range(TINY.num_layers)] + [""]


def test_sharded_parameter_errors():
    model = models.make_model("tiny", seed=0)
    hsdp.apply_hsdp_to_model(model, cfg())
    p = model.blocks[0].ffn[0].weight
    with pytest.raises(RuntimeError, match=r"sharded by hsdp in unit 'blocks\.0'"):
        p.data
    with pytest.raises(RuntimeError):
        p.data = np.zeros(p.shape, np.float32)
    with pytest.raises(RuntimeError, match="sharded"):
        model.state_dict()
    hsdp.unshard(model.blocks[0])
    with pytest.raises(ValueError):  # unsharded views are read-only: a write would be lost
        p.data[0, 0] = 1.0
    hsdp.reshard(model.blocks[0])
    with pytest.raises(ValueError, match="not an HSDP unit"):
        hsdp.unshard(model.blocks[0].ffn)


def test_output_dtype_bfloat16_rounds():
    x = models.make_inputs(TINY, seed=2)
    model = models.make_model("tiny", seed=0)
    hsdp.apply_hsdp_to_model(model, cfg(output_dtype="bfloat16"))
    out = model(*x)
    assert out.dtype == np.float32
    assert np.array_equal(out, hsdp._C.round_to(out, "bfloat16"))
    raw = models.make_model("tiny", seed=0)
    for p in raw.parameters():
        p.data = hsdp._C.round_to(p.data, "bfloat16")
    assert np.array_equal(out, hsdp._C.round_to(raw(*x), "bfloat16"))


def test_output_dtype_and_input_cast():
    x = models.make_inputs(TINY, seed=2)
    model = models.make_model("tiny", seed=0)
    hsdp.apply_hsdp_to_model(model, cfg(param_dtype="float32", output_dtype="float16"))
    out = model(*x)
    assert out.dtype == np.float16
    # float64 inputs are cast to the compute dtype of param_dtype (float32) on the way in
    out64 = model(*(a.astype(np.float64) for a in x))
    assert np.array_equal(out64, out)


def test_float16_param_dtype_unshards_float16_views():
    x = models.make_inputs(TINY, seed=2)
    model = models.make_model("tiny", seed=0)
    hsdp.apply_hsdp_to_model(model, cfg(param_dtype="float16"))
    hsdp.unshard(model, recurse=True)
    assert all(p.data.dtype == np.float16 for p in model.parameters())
    hsdp.reshard(model, recurse=True)
    assert np.isfinite(model(*x)).all()


def _fp8_model():
    model = models.make_model("tiny", seed=0)
    w = model.blocks[0].ffn[0].weight
    w._set_dtype(hsdp.float8_e4m3fn)
    return model


def test_fp8_model_keeps_every_dtype():
    model = _fp8_model()
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["blocks.0.ffn.0.weight"] == hsdp.float8_e4m3fn
    x = models.make_inputs(TINY, seed=1)
    expect = model(*x)
    hsdp.apply_hsdp_to_model(model, cfg())  # param_dtype bf16 is overridden: FP8 present
    assert {n: p.dtype for n, p in model.named_parameters()} == dtypes
    assert np.array_equal(model(*x), expect)


def test_preserve_parameter_dtypes_flag():
    model = models.make_model("tiny", seed=0)
    model._hsdp_preserve_parameter_dtypes = True
    x = models.make_inputs(TINY, seed=1)
    expect = model(*x)
    hsdp.apply_hsdp_to_model(model, cfg())
    assert all(p.dtype == hsdp.float32 for p in model.parameters())
    assert np.array_equal(model(*x), expect)


def test_forward_exception_reshards():
    model = models.make_model("tiny", seed=0)
    hsdp.apply_hsdp_to_model(model, cfg())
    with pytest.raises(ValueError):
        model(np.zeros((1, TINY.in_channels, 1, 3, 3), np.float32), np.zeros(1, np.float32),
              np.zeros((1, 4, TINY.text_dim), np.float32))
    assert not any(u.unit.is_unsharded for u in hsdp.get_units(model))
    assert hsdp.memory_stats()["unsharded_bytes"] == 0


# --------------------------------------------------------------------------- nested and uneven


class Odd(nn.Module):
    """Parameters of awkward sizes: primes, one element, a 0-dim scale, an int buffer-like."""

    def __init__(self, n: int) -> None:
        super().__init__()
        rng = np.random.default_rng(n)
        self.a = nn.Parameter(rng.standard_normal(n).astype(np.float32))
        self.b = nn.Parameter(rng.standard_normal((1,)).astype(np.float32))
        self.c = nn.Parameter(rng.standard_normal((n, 3)).astype(np.float32))
        self.inner = nn.Linear(3, 5)
        self.inner.weight.data = rng.standard_normal((5, 3)).astype(np.float32)

    def forward(self, x):
        return self.inner(x * self.b.data + self.c.data.sum(0)) + self.a.data.sum()


class OddModel(nn.Module):
    _hsdp_shard_conditions = [
        lambda name, m: re.fullmatch(r"parts\.\d+", name) is not None,
        lambda name, m: name.endswith(".inner"),  # nested inside a selected module
    ]

    def __init__(self) -> None:
        super().__init__()
        self.parts = nn.ModuleList([Odd(n) for n in (7, 13, 1, 101)])
        self.scale = nn.Parameter(np.array(0.5, np.float32))  # 0-dim: unshardable

    def forward(self, x):
        for p in self.parts:
            x = p(x)[..., :3]
        return x * self.scale.data


def test_nested_and_uneven():
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    model = OddModel()
    expect = model(x)
    with pytest.raises(ValueError, match="'scale'.*target_device"):
        hsdp.apply_hsdp_to_model(model, cfg(param_dtype="float32"))
    hsdp.apply_hsdp_to_model(model, cfg(param_dtype="float32"), target_device="cpu")
    units = {u.fqn: u for u in hsdp.get_units(model)}
    assert list(units) == ["parts.0.inner", "parts.0", "parts.1.inner", "parts.1", "parts.2.inner", "parts.2",
                           "parts.3.inner", "parts.3", ""]
    assert units["parts.0.inner"].names == ("parts.0.inner.weight", "parts.0.inner.bias")
    assert units["parts.0"].names == ("parts.0.a", "parts.0.b", "parts.0.c")
    assert units[""].names == ()  # the 0-dim scale is kept whole, not in the root unit
    assert model.scale.data == np.float32(0.5) and model.scale.data.ndim == 0
    assert np.array_equal(model(x), expect)


# --------------------------------------------------------------------------- errors leave the model as it was


def test_not_enabled():
    model = models.make_model("tiny", seed=0)
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"not enabled.*enabled=False"):
        hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig())
    assert_unchanged(model, snap)
    with pytest.raises(TypeError, match="HSDPInferenceConfig"):
        hsdp.apply_hsdp_to_model(model, {"enabled": True})


@pytest.mark.parametrize(
    "kw,pattern",
    [
        ({"hsdp_shard_size": 2}, r"hsdp_replicate_size=1 x hsdp_shard_size=2 = 2, but the world size is 1"),
        ({"hsdp_replicate_size": 2}, r"hsdp_replicate_size=2 does not divide the world size 1"),
        ({"hsdp_replicate_size": 2, "hsdp_shard_size": 1}, r"=2 x hsdp_shard_size=1 = 2.*world size is 1"),
    ],
)
def test_sizes_must_match_world(kw, pattern):
    model = models.make_model("tiny", seed=0)
    snap = snapshot(model)
    with pytest.raises(ValueError, match=pattern):
        hsdp.apply_hsdp_to_model(model, cfg(**kw))
    assert_unchanged(model, snap)


@pytest.mark.parametrize("conds", [None, []])
def test_missing_shard_conditions(conds):
    class NoConds(models.VideoDiT):
        _hsdp_shard_conditions = conds

    model = NoConds(TINY)
    models.init_weights(model, 0)
    snap = snapshot(model)
    with pytest.raises(ValueError, match="NoConds declares no _hsdp_shard_conditions"):
        hsdp.apply_hsdp_to_model(model, cfg())
    assert_unchanged(model, snap)


def test_shard_conditions_that_are_a_bare_function_are_a_type_error_naming_them():
    """A function where a list of them belongs: a TypeError naming the attribute (or the
    argument), the type and the fix, before anything changes."""
    model = models.make_model("tiny", seed=0)
    model._hsdp_shard_conditions = models.is_block
    snap = snapshot(model)
    fix = re.escape("got a function (") + ".*" + re.escape("); wrap it in a list: [is_block]")
    with pytest.raises(TypeError, match="VideoDiT._hsdp_shard_conditions must be a list of callables .*" + fix):
        hsdp.apply_hsdp_to_model(model, cfg())
    with pytest.raises(TypeError, match="^hsdp_shard_conditions must be a list of callables .*" + fix):
        hsdp.shard_model(model, hsdp_shard_conditions=models.is_block)
    with pytest.raises(TypeError, match=re.escape("got a str ('blocks.0'); wrap it in a list")):
        hsdp.shard_model(model, hsdp_shard_conditions="blocks.0")
    assert_unchanged(model, snap)


def test_a_module_list_selected_as_a_unit_is_refused_naming_it():
    """A ModuleList is never called, so a unit on it would never gather: refused, naming it."""
    class WholeList(models.VideoDiT):
        _hsdp_shard_conditions = [lambda name, m: name == "blocks"]

    model = WholeList(TINY)
    models.init_weights(model, 0)
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"'blocks' \(ModuleList\) cannot be an HSDP unit.*e\.g\. 'blocks\.0'"):
        hsdp.apply_hsdp_to_model(model, cfg())
    assert_unchanged(model, snap)


def test_a_parallel_config_where_an_hsdp_config_belongs_says_to_convert_it(tmp_path):
    """DiffusionParallelConfig holds the degrees; the sharding calls take its to_hsdp_config()."""
    model = models.make_model("tiny", seed=0)
    snap = snapshot(model)
    par = hsdp.DiffusionParallelConfig(use_hsdp=True, hsdp_shard_size=1)
    msg = r"HSDPInferenceConfig, got DiffusionParallelConfig; pass parallel_config\.to_hsdp_config\(\)"
    for call in (lambda: hsdp.apply_hsdp_to_model(model, par), lambda: hsdp.prepare_hsdp_shard_context(model, par),
                 lambda: hsdp.load_model_sharded(model, tmp_path / "none.safetensors", par)):
        with pytest.raises(TypeError, match=msg):
            call()
    assert_unchanged(model, snap)
    hsdp.apply_hsdp_to_model(model, par.to_hsdp_config())  # as the message says
    assert len(hsdp.get_units(model)) == TINY.num_layers + 1


def test_ignored_modules_need_target_device():
    model = models.make_model("tiny", variant="ignored", seed=0)
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"_hsdp_ignored_modules \['time_embedder'\].*target_device is None"):
        hsdp.apply_hsdp_to_model(model, cfg())
    assert_unchanged(model, snap)


def test_ignored_module_not_found_warns():
    class Missing(models.VideoDiT):
        _hsdp_ignored_modules = ["no_such.module"]

    model = Missing(TINY)
    models.init_weights(model, 0)
    with pytest.warns(UserWarning, match="no_such.module"):
        hsdp.apply_hsdp_to_model(model, cfg(), target_device="cpu")
    assert len(hsdp.get_units(model)) == TINY.num_layers + 1


def test_bad_target_device():
    model = models.make_model("tiny", variant="ignored", seed=0)
    snap = snapshot(model)
    with pytest.raises(ValueError, match="cuda:0"):
        hsdp.apply_hsdp_to_model(model, cfg(), target_device="cuda:0")
    assert_unchanged(model, snap)


def test_unshardable_need_target_device():
    model = models.make_model("tiny", variant="quantized", seed=0)
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"cannot be sharded \('blocks\.0\.ffn\.0\.weight' \(int8"):
        hsdp.apply_hsdp_to_model(model, cfg())
    assert_unchanged(model, snap)


def test_condition_selecting_root():
    class RootToo(models.VideoDiT):
        _hsdp_shard_conditions = [lambda name, m: isinstance(m, models.VideoDiT) or models.is_block(name, m)]

    model = RootToo(TINY)
    models.init_weights(model, 0)
    snap = snapshot(model)
    with pytest.raises(ValueError, match="selects the root module \\(RootToo\\)"):
        hsdp.apply_hsdp_to_model(model, cfg())
    assert_unchanged(model, snap)


def test_nothing_selected():
    class Nothing(models.VideoDiT):
        _hsdp_shard_conditions = [lambda name, m: name == "no.such.block"]

    model = Nothing(TINY)
    models.init_weights(model, 0)
    snap = snapshot(model)
    stats = hsdp.memory_stats()
    with pytest.raises(ValueError, match="no submodule of Nothing matched"):
        hsdp.apply_hsdp_to_model(model, cfg())
    assert_unchanged(model, snap)
    assert hsdp.memory_stats()["sharded_bytes"] == stats["sharded_bytes"]


def test_failure_in_a_later_unit_rolls_back():
    """shard_model builds every unit before it commits any: an error in the last block
    leaves the earlier, already built, blocks untouched and frees their shards."""
    model = models.make_model("tiny", seed=0)
    last = model.blocks[len(model.blocks) - 1]
    last.register_parameter("packed", nn.Parameter(np.arange(6, dtype=np.int8)))
    snap = snapshot(model)
    gc.collect()
    before = hsdp.memory_stats()["sharded_bytes"]
    with pytest.raises(ValueError, match=r"'blocks\.1\.packed' \(int8.*ignored_params"):
        hsdp.shard_model(model, hsdp_shard_conditions=[models.is_block],
                         mp_policy=hsdp.MixedPrecisionPolicy(param_dtype="bfloat16"))
    assert_unchanged(model, snap)
    gc.collect()
    assert hsdp.memory_stats()["sharded_bytes"] == before
    # with the packed parameter ignored it works, and the parameter stays whole
    hsdp.shard_model(model, hsdp_shard_conditions=[models.is_block], ignored_params={last.packed})
    assert np.array_equal(last.packed.data, np.arange(6, dtype=np.int8))


def test_non_module_is_a_type_error_naming_its_class():
    class FakeTorch:  # looks like torch by its module name, but is no torch.nn.Module
        def named_modules(self):
            return iter(())

    FakeTorch.__module__ = "torch.nn.modules.module"
    with pytest.raises(TypeError, match=r"torch.nn.Module or an hsdp.nn.Module, got torch.nn.modules.module.FakeTorch"):
        hsdp.apply_hsdp_to_model(FakeTorch(), cfg())
    with pytest.raises(TypeError, match="hsdp.nn.Module"):
        hsdp.apply_hsdp_to_model(object(), cfg())


def test_streaming_api_errors():
    model = models.make_model("tiny", seed=0)
    ctx = hsdp.prepare_hsdp_shard_context(model, cfg())
    assert isinstance(ctx, hsdp.HSDPShardContext)
    with pytest.raises(ValueError, match="finalize_hsdp_root"):
        hsdp.shard_hsdp_module(model, ctx)
    with pytest.raises(ValueError, match="not a submodule"):
        hsdp.shard_hsdp_module(nn.Linear(2, 2), ctx)
    hsdp.shard_hsdp_module(model.blocks[0], ctx)
    with pytest.raises(RuntimeError, match="already an HSDP unit"):
        hsdp.shard_hsdp_module(model.blocks[0], ctx)
    with pytest.raises(ValueError, match="different model"):
        hsdp.finalize_hsdp_root(models.make_model("tiny"), ctx)
    hsdp.finalize_hsdp_root(model, ctx)
    with pytest.raises(RuntimeError, match="already sharded its root"):
        hsdp.finalize_hsdp_root(model, ctx)
    with pytest.raises(RuntimeError, match="already sharded its root"):
        hsdp.shard_hsdp_module(model.blocks[1], ctx)
    # the block sharded before the root and the rest: same forward as the unsharded model
    x = models.make_inputs(TINY, seed=0)
    ref = models.make_model("tiny", seed=0)
    for p in ref.parameters():
        p.data = hsdp._C.round_to(p.data, "bfloat16")
    assert np.array_equal(model(*x), ref(*x))


def test_meta_model_shards_zeros():
    """A model built under meta_init shards without weight memory; its shards start zeroed
    (a loader fills them)."""
    with nn.meta_init():
        model = models.make_model("tiny")
    assert all(p.is_meta for p in model.parameters())
    hsdp.apply_hsdp_to_model(model, cfg())
    hsdp.unshard(model, recurse=True)
    assert all(not p.data.any() for p in model.parameters())
    hsdp.reshard(model, recurse=True)


def test_a_sharded_parameter_replaced_after_sharding_fails_the_next_forward_naming_it():
    """The unit holds the old Parameter's shard: the new one would run silently otherwise."""
    import numpy as np

    from hsdp import models

    model = models.make_model("tiny", seed=0)
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, param_dtype="float32"))
    x = models.make_inputs(models.DiTConfig.preset("tiny"), seed=3)
    model(*x)
    q = model.blocks[0].self_attn.q
    q.weight = hsdp.nn.Parameter(np.zeros((32, 32), dtype=np.float32))
    with pytest.raises(RuntimeError, match=r"unusable: parameter 'blocks.0.self_attn.q.weight' was replaced"):
        model(*x)
