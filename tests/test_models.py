"""hsdp.models: the reference video DiT, its presets, variants and determinism."""

from __future__ import annotations

import re
import weakref

import numpy as np
import pytest

from hsdp.engine import dtypes
from hsdp import nn
from hsdp.models import (
    PRESETS,
    VARIANTS,
    DiTConfig,
    QuantLinear,
    VideoDiT,
    VideoDiTIgnoredTimeEmbedder,
    VideoDiTQuantized,
    init_weights,
    is_block,
    make_inputs,
    make_model,
    param_nbytes,
    preset_names,
)


@pytest.fixture(scope="module")
def tiny_inputs():
    return make_inputs("tiny")


def test_presets():
    assert preset_names() == ["tiny", "small", "base", "large"]
    tiny = DiTConfig.preset("tiny")
    assert (tiny.dim, tiny.ffn_dim, tiny.num_heads, tiny.num_layers, tiny.text_dim, tiny.freq_dim) == (
        32, 64, 2, 2, 16, 32,
    )
    small = DiTConfig.preset("small")
    assert (small.dim, small.num_layers) == (128, 4)
    base = DiTConfig.preset("base")
    assert (base.dim, base.ffn_dim, base.num_layers) == (512, 2048, 8)
    large = DiTConfig.preset("large")
    assert (large.dim, large.ffn_dim, large.num_heads, large.num_layers, large.text_dim) == (1024, 4096, 16, 6, 1024)
    for cfg in PRESETS.values():
        assert (cfg.in_channels, cfg.out_channels, cfg.patch_size) == (16, 16, (1, 2, 2))
    with pytest.raises(ValueError) as err:
        DiTConfig.preset("huge")
    assert "huge" in str(err.value) and all(n in str(err.value) for n in PRESETS)


def test_preset_sizes_under_meta_init():
    sizes = {}
    with nn.meta_init():
        for name in preset_names():
            m = make_model(name)
            assert all(p.is_meta for p in m.parameters())
            sizes[name] = param_nbytes(m)
    assert 100_000 < sizes["tiny"] < 1_000_000
    assert sizes["tiny"] < sizes["small"] < sizes["base"] < sizes["large"]
    assert 200e6 < sizes["large"] < 1e9


def test_bad_config():
    with pytest.raises(ValueError, match="num_heads"):
        DiTConfig(dim=30, num_heads=4)
    with pytest.raises(ValueError, match="variant"):
        make_model("tiny", variant="nope")


@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_shape_all_variants(variant, tiny_inputs):
    model = make_model("tiny", variant)
    x, t, ctx = tiny_inputs
    y = model(x, t, ctx)
    assert y.shape == x.shape and y.dtype == np.float32 and np.isfinite(y).all()
    x2, t2, c2 = make_inputs(model.config, batch=2, frames=3, height=4, width=6, text_len=5)
    assert model(x2, t2, c2).shape == (2, 16, 3, 4, 6)


def test_determinism_same_seed_same_bits(tiny_inputs):
    x, t, ctx = tiny_inputs
    a = make_model("tiny", seed=0)(x, t, ctx)
    b = make_model("tiny", seed=0)(x, t, ctx)
    assert a.tobytes() == b.tobytes()
    c = make_model("tiny", seed=1)(x, t, ctx)
    assert not np.array_equal(a, c)
    x2, t2, c2 = make_inputs("tiny", seed=1)
    assert x2.tobytes() == x.tobytes()
    assert not np.array_equal(make_inputs("tiny", seed=2)[0], x)


def test_init_weights_fills_as_documented():
    m = make_model("tiny")
    sd = m.state_dict()
    np.testing.assert_array_equal(sd["blocks.0.norm3.weight"], 1.0)
    np.testing.assert_array_equal(sd["blocks.1.self_attn.norm_q.weight"], 1.0)
    w = sd["blocks.0.ffn.0.weight"]
    assert w.std() > 0 and np.abs(w).max() <= 1 / np.sqrt(32)
    assert 0 < np.abs(sd["blocks.0.modulation"]).max() < 0.2
    assert not np.array_equal(sd["blocks.0.self_attn.q.weight"], sd["blocks.0.self_attn.k.weight"])
    assert not np.array_equal(sd["blocks.0.self_attn.q.weight"], sd["blocks.1.self_attn.q.weight"])


def test_init_weights_streams_one_block_at_a_time():
    full = make_model("tiny", seed=3)
    with nn.meta_init():
        streamed = make_model("tiny")
    # Materialise and fill only block 1, as a streaming loader would.
    block = streamed.blocks[1]
    for p in block.parameters():
        p.data = np.zeros(p.shape)
    init_weights(block, seed=3, prefix="blocks.1")
    for name, p in block.named_parameters(prefix="blocks.1"):
        assert p.data.tobytes() == full.get_parameter(name).data.tobytes(), name
    assert all(p.is_meta for p in streamed.blocks[0].parameters())


def test_module_names_and_shard_condition():
    m = make_model("tiny")
    children = [n for n, _ in m.named_children()]
    assert children == [
        "patch_embedding", "text_embedder", "time_embedder", "time_projection", "blocks", "norm_out", "head",
    ]
    names = [n for n, _ in m.named_modules()]
    assert [n for n in names if is_block(n, m.get_submodule(n))] == ["blocks.0", "blocks.1"]
    assert not is_block("blocks", m.blocks) and not is_block("blocks.0.ffn", m.blocks[0].ffn)
    assert not is_block("xblocks.0", m.blocks[0])
    assert VideoDiT._hsdp_shard_conditions == [is_block]
    assert VideoDiT._hsdp_preserve_parameter_dtypes is False
    params = dict(m.named_parameters())
    for key in [
        "patch_embedding.weight", "text_embedder.0.weight", "text_embedder.2.bias", "time_embedder.0.weight",
        "time_projection.1.weight", "blocks.0.self_attn.q.weight", "blocks.0.self_attn.norm_k.weight",
        "blocks.1.cross_attn.o.bias", "blocks.1.norm3.bias", "blocks.0.ffn.2.weight", "blocks.0.modulation",
        "head.weight", "scale_shift_table",
    ]:
        assert key in params, key
    assert params["blocks.0.modulation"].shape == (1, 6, 32)
    assert params["scale_shift_table"].shape == (1, 2, 32)
    assert params["time_projection.1.weight"].shape == (6 * 32, 32)
    assert params["patch_embedding.weight"].shape == (32, 16 * 1 * 2 * 2)
    assert not any(re.search(r"norm[12]\.|norm_out\.", n) for n in params)  # no-affine norms
    # Each block owns its parameters: none appears under two block names.
    block_params = [set(map(id, b.parameters())) for b in m.blocks]
    assert not block_params[0] & block_params[1]


def test_quantized_variant():
    m = make_model("tiny", "quantized")
    assert isinstance(m, VideoDiTQuantized)
    ffn0 = m.get_submodule("blocks.0.ffn.0")
    assert isinstance(ffn0, QuantLinear)
    assert ffn0.weight.dtype is dtypes.int8 and ffn0.weight.shape == (64, 32)
    assert ffn0.weight.data.dtype == np.int8 and np.abs(ffn0.weight.data.astype(int)).max() <= 127
    assert ffn0.scale.shape == () and ffn0.scale.ndim == 0 and ffn0.scale.dtype is dtypes.float32
    assert ffn0.scale.data.shape == () and ffn0.scale.data > 0
    assert ffn0.bias.dtype is dtypes.float32
    # Only the blocks' FFNs are quantized.
    assert type(m.get_submodule("blocks.1.self_attn.q")) is nn.Linear
    assert type(m.get_submodule("head")) is nn.Linear
    int_params = [n for n, p in m.named_parameters() if not p.is_floating_point()]
    assert int_params == [f"blocks.{i}.ffn.{j}.weight" for i in range(2) for j in (0, 2)]
    x = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)
    ref = x.astype(np.float64) @ (ffn0.weight.data.astype(np.float64) * float(ffn0.scale.data)).T + ffn0.bias.data
    np.testing.assert_allclose(ffn0(x), ref, rtol=1e-5, atol=1e-6)
    # bfloat16 elsewhere leaves the packed weights and their scales alone.
    with nn.meta_init():
        mb = make_model("tiny", "quantized", dtype="bfloat16")
    assert mb.get_parameter("blocks.0.ffn.0.weight").dtype is dtypes.int8
    assert mb.get_parameter("blocks.0.ffn.0.scale").dtype is dtypes.float32
    assert mb.get_parameter("blocks.0.self_attn.q.weight").dtype is dtypes.bfloat16


def test_ignored_variant():
    assert VideoDiTIgnoredTimeEmbedder._hsdp_ignored_modules == ["time_embedder"]
    assert not hasattr(VideoDiT, "_hsdp_ignored_modules")
    with nn.meta_init():
        m = make_model("tiny", "ignored", dtype="bfloat16")
    for name in m._hsdp_ignored_modules:
        assert m.get_submodule(name) is m.time_embedder
    for name, p in m.named_parameters():
        expected = dtypes.float32 if name.startswith("time_embedder.") else dtypes.bfloat16
        assert p.dtype is expected, name
    # Same names and seeds as the plain model: identical float32 outputs.
    x, t, ctx = make_inputs("tiny")
    a = make_model("tiny", "ignored")(x, t, ctx)
    assert a.tobytes() == make_model("tiny")(x, t, ctx).tobytes()


def test_bfloat16_model_runs():
    import hsdp._C  # noqa: F401  (needs the C core: a broken build fails, never skips)
    m = make_model("tiny", dtype="bfloat16")
    w = m.get_parameter("blocks.0.self_attn.q.weight")
    assert w.dtype is dtypes.bfloat16 and w.data.dtype == np.float32 and w.nbytes == 32 * 32 * 2
    bits = w.data.view(np.uint32)
    assert not (bits & 0xFFFF).any()  # rounded to bf16: low 16 bits clear
    y = m(*make_inputs("tiny"))
    y32 = make_model("tiny")(*make_inputs("tiny"))
    assert np.isfinite(y).all() and not np.array_equal(y, y32)
    np.testing.assert_allclose(y, y32, atol=0.1)


def test_meta_model_has_no_data():
    with nn.meta_init():
        m = make_model("tiny", "quantized")
    params = list(m.parameters())
    assert params and all(p.is_meta and p._data is None for p in params)
    assert param_nbytes(m) == sum(p.numel() * p.dtype.itemsize for p in params)
    with pytest.raises(RuntimeError, match="meta_init"):
        m(*make_inputs("tiny"))


@pytest.mark.parametrize(
    "shape",
    [(1, 16, 2, 7, 8), (1, 16, 2, 8), (1, 15, 2, 8, 8)],
)
def test_bad_input_shape_names_it(shape, tiny_inputs):
    m = make_model("tiny")
    _, t, ctx = tiny_inputs
    with pytest.raises(ValueError) as err:
        m(np.zeros(shape, dtype=np.float32), t, ctx)
    assert str(shape) in str(err.value)


def test_bad_context_and_timestep(tiny_inputs):
    m = make_model("tiny")
    x, t, ctx = tiny_inputs
    with pytest.raises(ValueError, match=re.escape("(1, 8, 15)")):
        m(x, t, ctx[..., :15])
    with pytest.raises(ValueError, match="timestep"):
        m(x, np.zeros(2, dtype=np.float32), ctx)


def test_sharded_block_parameter_fails_loudly(tiny_inputs):
    m = make_model("tiny")
    p = m.get_parameter("blocks.1.ffn.0.weight")
    p._data = None
    p._hsdp_state = "sharded by hsdp in unit 'blocks.1'"
    with pytest.raises(RuntimeError, match="blocks.1"):
        m(*tiny_inputs)


def test_engine_style_hooks_give_identical_output(tiny_inputs):
    """Simulate the engine: each block's weights exist only inside its forward."""
    ref = make_model("tiny")(*tiny_inputs)
    m = make_model("tiny")
    saved = {}
    alive = []

    def shard(block, name):
        for p in block.parameters():
            saved.setdefault(id(p), p._data)  # the "shard": the first, full array
            p._data = None
            p._hsdp_state = f"sharded by hsdp in unit '{name}'"

    def pre(block, args):
        for p in block.parameters():
            view = saved[id(p)].view()
            view.flags.writeable = False
            alive.append(weakref.ref(view))
            p._data, p._hsdp_state = view, None

    for i, block in enumerate(m.blocks):
        name = f"blocks.{i}"
        shard(block, name)
        block.register_forward_pre_hook(pre)
        block.register_forward_hook(lambda mod, a, out, name=name: shard(mod, name), always_call=True)
    out = m(*tiny_inputs)
    assert out.tobytes() == ref.tobytes()
    assert all(r() is None for r in alive)  # no forward kept a view alive
    assert all(p._data is None for p in m.blocks.parameters())


# -- the block and the model against straightforward float64 formulas -----------------------


def _lin(layer, a):
    return a @ layer.weight.data.astype(np.float64).T + layer.bias.data


def _ln(a, w=None, b=None, eps=1e-6):
    mu = a.mean(-1, keepdims=True)
    y = (a - mu) / np.sqrt(((a - mu) ** 2).mean(-1, keepdims=True) + eps)
    return y if w is None else y * w.data + b.data


def _attn(attn, x, src):
    def rms(norm, a):
        return a / np.sqrt((a**2).mean(-1, keepdims=True) + 1e-6) * norm.weight.data

    bsz, n, dim = x.shape
    h = attn.num_heads
    q = rms(attn.norm_q, _lin(attn.q, x)).reshape(bsz, n, h, -1)
    k = rms(attn.norm_k, _lin(attn.k, src)).reshape(bsz, src.shape[1], h, -1)
    v = _lin(attn.v, src).reshape(bsz, src.shape[1], h, -1)
    s = np.einsum("blhd,bshd->bhls", q, k) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return _lin(attn.o, np.einsum("bhls,bshd->blhd", p, v).reshape(bsz, n, dim))


def test_block_matches_wan_formula():
    m = make_model("tiny", seed=5)
    block = m.blocks[0]
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 6, 32))
    t_mod = 0.3 * rng.standard_normal((2, 6, 32))
    ctx = rng.standard_normal((2, 4, 32))
    # Distinct modulation rows so that a mixed-up shift/scale/gate order shows.
    block.modulation.data = 0.5 * rng.standard_normal((1, 6, 32))
    got = block(x.astype(np.float32), t_mod.astype(np.float32), ctx.astype(np.float32))

    e = block.modulation.data + t_mod
    shift1, scale1, gate1, shift2, scale2, gate2 = (e[:, i : i + 1] for i in range(6))
    y = x + gate1 * _attn(block.self_attn, _ln(x) * (1 + scale1) + shift1, _ln(x) * (1 + scale1) + shift1)
    y = y + _attn(block.cross_attn, _ln(y, block.norm3.weight, block.norm3.bias), ctx)
    h = _lin(block.ffn[0], _ln(y) * (1 + scale2) + shift2)
    h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
    ref = y + gate2 * _lin(block.ffn[2], h)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_patchify_and_unpatchify_follow_conv3d_layout():
    m = make_model("tiny")
    x, t, ctx = make_inputs("tiny", batch=1, frames=2, height=4, width=6)
    seen = {}
    m.patch_embedding.register_forward_pre_hook(lambda mod, args: seen.setdefault("tokens", args[0]))
    m.head.register_forward_hook(lambda mod, args, out: seen.setdefault("head", out))
    y = m(x, t, ctx)
    tokens, head = seen["tokens"], seen["head"]
    gh, gw = 2, 3  # (1, 2, 2) patches over H=4, W=6
    assert tokens.shape == (1, 2 * gh * gw, 16 * 4) and head.shape == (1, 2 * gh * gw, 16 * 4)
    for ti in range(2):
        for hi in range(gh):
            for wi in range(gw):
                n = (ti * gh + hi) * gw + wi
                patch = x[0, :, ti, 2 * hi : 2 * hi + 2, 2 * wi : 2 * wi + 2]  # (C, ph, pw)
                np.testing.assert_array_equal(tokens[0, n], patch.reshape(-1))
                np.testing.assert_array_equal(y[0, :, ti, 2 * hi : 2 * hi + 2, 2 * wi : 2 * wi + 2].reshape(-1), head[0, n])


def test_timestep_embedding_formula():
    from hsdp.models import timestep_embedding

    t = np.array([0.0, 10.0, 999.0], dtype=np.float32)
    emb = timestep_embedding(t, 8)
    freqs = 10000.0 ** (-np.arange(4) / 4)
    ref = np.concatenate([np.cos(np.outer(t, freqs)), np.sin(np.outer(t, freqs))], axis=1)
    assert emb.shape == (3, 8) and emb.dtype == np.float32
    np.testing.assert_allclose(emb, ref, rtol=1e-6, atol=1e-6)


def test_head_modulation_uses_scale_shift_table():
    m = make_model("tiny")
    m.scale_shift_table.data = np.random.default_rng(3).standard_normal((1, 2, 32))
    seen = {}
    m.time_embedder.register_forward_hook(lambda mod, a, out: seen.setdefault("temb", out))
    m.norm_out.register_forward_pre_hook(lambda mod, a: seen.setdefault("tokens", a[0]))
    m.head.register_forward_pre_hook(lambda mod, a: seen.setdefault("head_in", a[0]))
    m(*make_inputs("tiny"))
    e = m.scale_shift_table.data + seen["temb"][:, None, :].astype(np.float64)
    ref = _ln(seen["tokens"].astype(np.float64)) * (1 + e[:, 1:2]) + e[:, 0:1]
    np.testing.assert_allclose(seen["head_in"], ref, rtol=1e-4, atol=1e-4)
