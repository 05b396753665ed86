"""A reference video diffusion transformer with the block structure of Wan2.x.

Patch embedding, text and timestep embedders, ``blocks.<i>`` (adaLN-modulated self-attention,
cross-attention to the text, feed-forward), output norm and head. hsdp shards each
``blocks.<i>`` as one unit (``_hsdp_shard_conditions``); the root unit holds the rest.
Positional encoding (Wan's 3-D RoPE) is left out: it has no parameters and changes nothing
about sharding.
"""

from __future__ import annotations

import dataclasses
import math
import re
import zlib
from typing import Any, ClassVar

import numpy as np

from ..engine.dtypes import DType, as_dtype, float32
from ..nn import functional as F
from ..nn.init import is_meta_init
from ..nn.layers import GELU, LayerNorm, Linear, RMSNorm, SiLU
from ..nn.module import Module, ModuleList, Sequential
from ..nn.parameter import Parameter


@dataclasses.dataclass(frozen=True)
class DiTConfig:
    in_channels: int = 16
    out_channels: int = 16
    patch_size: tuple[int, int, int] = (1, 2, 2)
    dim: int = 32
    ffn_dim: int = 64
    num_heads: int = 2
    num_layers: int = 2
    text_dim: int = 16
    freq_dim: int = 256
    eps: float = 1e-6

    def __post_init__(self) -> None:
        object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise ValueError(f"patch_size must be three positive ints (t, h, w), got {self.patch_size}")
        if self.dim % self.num_heads:
            raise ValueError(f"dim {self.dim} is not divisible by num_heads {self.num_heads}")
        if self.freq_dim % 2:
            raise ValueError(f"freq_dim must be even (cos and sin halves), got {self.freq_dim}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        return math.prod(self.patch_size)

    @classmethod
    def preset(cls, name: str) -> "DiTConfig":
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown DiT preset {name!r}; known presets: {', '.join(PRESETS)}") from None


PRESETS: dict[str, DiTConfig] = {
    # ~170 KB of float32: for tests.
    "tiny": DiTConfig(dim=32, ffn_dim=64, num_heads=2, num_layers=2, text_dim=16, freq_dim=32),
    # ~4 MB.
    "small": DiTConfig(dim=128, ffn_dim=512, num_heads=4, num_layers=4, text_dim=64, freq_dim=64),
    # ~150 MB.
    "base": DiTConfig(dim=512, ffn_dim=2048, num_heads=8, num_layers=8, text_dim=256, freq_dim=256),
    # ~430 MB: for benchmarks.
    "large": DiTConfig(dim=1024, ffn_dim=4096, num_heads=16, num_layers=6, text_dim=1024, freq_dim=256),
}


def preset_names() -> list[str]:
    return list(PRESETS)


def is_block(name: str, module: Module) -> bool:
    """The shard condition: each transformer block ``blocks.<i>`` is one unit."""
    return re.fullmatch(r"blocks\.\d+", name) is not None


class Attention(Module):
    """Multi-head attention with RMS-normed q and k; ``context`` given -> cross-attention.
    Self-attention runs over the whole sequence through ``_hsdp_ulysses`` when it is set
    (``hsdp.parallel.apply_sequence_parallel``)."""

    _hsdp_ulysses: ClassVar[Any] = None

    def __init__(self, dim: int, num_heads: int, eps: float = 1e-6, dtype: Any = float32) -> None:
        super().__init__()
        self.dim = dim
        self.num_heads = num_heads
        self.q = Linear(dim, dim, dtype=dtype)
        self.k = Linear(dim, dim, dtype=dtype)
        self.v = Linear(dim, dim, dtype=dtype)
        self.o = Linear(dim, dim, dtype=dtype)
        self.norm_q = RMSNorm(dim, eps, dtype=dtype)
        self.norm_k = RMSNorm(dim, eps, dtype=dtype)

    def _heads(self, t: np.ndarray) -> np.ndarray:
        b, n, _ = t.shape
        return t.reshape(b, n, self.num_heads, self.dim // self.num_heads).transpose(0, 2, 1, 3)

    def forward(self, x: np.ndarray, context: np.ndarray | None = None) -> np.ndarray:
        sp = self._hsdp_ulysses
        if context is None and sp is not None:
            out = self._ulysses(x, sp)
        else:
            src = x if context is None else context
            q = self._heads(self.norm_q(self.q(x)))
            k = self._heads(self.norm_k(self.k(src)))
            v = self._heads(self.v(src))
            out = F.scaled_dot_product_attention(q, k, v)
        b, _, n, _ = out.shape
        return self.o(out.transpose(0, 2, 1, 3).reshape(b, n, self.dim))

    def _ulysses(self, x: np.ndarray, sp: Any) -> np.ndarray:
        # q, k and v land straight in the exchange's head-group-major buffers (their last
        # elementwise step writes there, the same bits as in place), so the all-to-all sends
        # them as they lie: no packing pass, no strided send.
        # The buffers are asked for by dtype from inside each op: the weights that decide it
        # may be gathered only when the module is called (a module that is its own unit).
        b, n, _ = x.shape
        h, d = self.num_heads, self.dim // self.num_heads
        sp.check_heads(h)

        def grouped(dtype: Any) -> np.ndarray:
            return sp.grouped(b, n, h, d, dtype)

        q = self.norm_q(self.q(x), out=grouped)
        k = self.norm_k(self.k(x), out=grouped)
        v = self.v(x, out=grouped)
        return sp.attention_grouped(q, k, v, d, F.scaled_dot_product_attention)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}"


class DiTBlock(Module):
    """Wan-style block: adaLN-modulated self-attention and FFN, plain cross-attention."""

    def __init__(self, config: DiTConfig, dtype: Any = float32, ffn_linear: type[Module] = Linear) -> None:
        super().__init__()
        c = config
        self.norm1 = LayerNorm(c.dim, c.eps, elementwise_affine=False)
        self.self_attn = Attention(c.dim, c.num_heads, c.eps, dtype=dtype)
        self.norm3 = LayerNorm(c.dim, c.eps, elementwise_affine=True, dtype=dtype)
        self.cross_attn = Attention(c.dim, c.num_heads, c.eps, dtype=dtype)
        self.norm2 = LayerNorm(c.dim, c.eps, elementwise_affine=False)
        self.ffn = Sequential(
            ffn_linear(c.dim, c.ffn_dim, dtype=dtype), GELU("tanh"), ffn_linear(c.ffn_dim, c.dim, dtype=dtype)
        )
        self.modulation = Parameter._filled((1, 6, c.dim), dtype, 0.0)

    def forward(self, x: np.ndarray, t_mod: np.ndarray, context: np.ndarray) -> np.ndarray:
        # e[:, i] for i = shift, scale, gate (self-attention), then shift, scale, gate (FFN).
        e = self.modulation.data + t_mod  # (B, 6, dim), a new array: nothing aliases the weight
        shift1, scale1, gate1, shift2, scale2, gate2 = (e[:, i : i + 1] for i in range(6))
        x = x + gate1 * self.self_attn(self.norm1(x) * (1 + scale1) + shift1)
        x = x + self.cross_attn(self.norm3(x), context)
        x = x + gate2 * self.ffn(self.norm2(x) * (1 + scale2) + shift2)
        return x


def timestep_embedding(timestep: np.ndarray, freq_dim: int) -> np.ndarray:
    """Sinusoidal embedding (B,) -> (B, freq_dim): cos half then sin half, as Wan does."""
    half = freq_dim // 2
    freqs = np.power(10000.0, -np.arange(half, dtype=np.float64) / half)
    angles = np.outer(timestep.astype(np.float64), freqs)
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)


class VideoDiT(Module):
    """Video DiT: latents (B, C, T, H, W), timestep (B,), text context (B, L, text_dim)."""

    _hsdp_shard_conditions: ClassVar[list[Any]] = [is_block]
    _hsdp_preserve_parameter_dtypes: ClassVar[bool] = False
    # Set by hsdp.parallel.apply_sequence_parallel: the tokens are split over its ranks.
    _hsdp_ulysses: ClassVar[Any] = None
    # Variants override these instead of re-writing the constructor.
    _ffn_linear: ClassVar[type[Module]] = Linear
    _time_embedder_dtype: ClassVar[DType | None] = None

    def __init__(self, config: DiTConfig | None = None, dtype: Any = float32) -> None:
        super().__init__()
        c = DiTConfig() if config is None else config
        dt = as_dtype(dtype)
        t_dt = self._time_embedder_dtype or dt
        self.config = c
        self.patch_embedding = Linear(c.in_channels * c.patch_dim, c.dim, dtype=dt)
        self.text_embedder = Sequential(
            Linear(c.text_dim, c.dim, dtype=dt), GELU("tanh"), Linear(c.dim, c.dim, dtype=dt)
        )
        self.time_embedder = Sequential(
            Linear(c.freq_dim, c.dim, dtype=t_dt), SiLU(), Linear(c.dim, c.dim, dtype=t_dt)
        )
        self.time_projection = Sequential(SiLU(), Linear(c.dim, 6 * c.dim, dtype=dt))
        self.blocks = ModuleList(DiTBlock(c, dt, self._ffn_linear) for _ in range(c.num_layers))
        self.norm_out = LayerNorm(c.dim, c.eps, elementwise_affine=False)
        self.head = Linear(c.dim, c.out_channels * c.patch_dim, dtype=dt)
        self.scale_shift_table = Parameter._filled((1, 2, c.dim), dt, 0.0)

    def _check_inputs(self, x: np.ndarray, timestep: np.ndarray, context: np.ndarray) -> None:
        c = self.config
        if x.ndim != 5 or x.shape[1] != c.in_channels:
            raise ValueError(
                f"x must be latents of shape (B, {c.in_channels}, T, H, W), got shape {x.shape}"
            )
        if any(n % p for n, p in zip(x.shape[2:], c.patch_size)):
            raise ValueError(
                f"x of shape {x.shape}: T, H, W = {x.shape[2:]} must be divisible by the patch size {c.patch_size}"
            )
        b = x.shape[0]
        if timestep.shape != (b,):
            raise ValueError(f"timestep must have shape ({b},), got shape {timestep.shape}")
        if context.ndim != 3 or context.shape[0] != b or context.shape[2] != c.text_dim:
            raise ValueError(f"context must have shape ({b}, L, {c.text_dim}), got shape {context.shape}")

    def forward(self, x: Any, timestep: Any, context: Any) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        timestep = np.asarray(timestep, dtype=np.float32)
        if timestep.ndim == 0:
            timestep = np.full((x.shape[0] if x.ndim else 1,), timestep, dtype=np.float32)
        context = np.asarray(context, dtype=np.float32)
        self._check_inputs(x, timestep, context)
        c = self.config
        b, ch, t, h, w = x.shape
        pt, ph, pw = c.patch_size
        gt, gh, gw = t // pt, h // ph, w // pw

        # Patchify: each (pt, ph, pw) patch, channels first, becomes one token (as Conv3d would).
        patches = x.reshape(b, ch, gt, pt, gh, ph, gw, pw).transpose(0, 2, 4, 6, 1, 3, 5, 7)
        tokens = self.patch_embedding(patches.reshape(b, gt * gh * gw, ch * pt * ph * pw))
        sp = self._hsdp_ulysses
        if sp is not None:  # this rank's share of the tokens from here to the head
            tokens = sp.split_tokens(tokens)

        temb = self.time_embedder(timestep_embedding(timestep, c.freq_dim))  # (B, dim)
        t_mod = self.time_projection(temb).reshape(b, 6, c.dim)
        ctx = self.text_embedder(context)

        for block in self.blocks:
            tokens = block(tokens, t_mod, ctx)

        e = self.scale_shift_table.data + temb[:, None, :]  # (B, 2, dim): shift, scale
        out = self.head(self.norm_out(tokens) * (1 + e[:, 1:2]) + e[:, 0:1])
        if sp is not None:
            out = sp.gather_tokens(out)

        # Unpatchify: the inverse of the patchify above.
        out = out.reshape(b, gt, gh, gw, c.out_channels, pt, ph, pw).transpose(0, 4, 1, 5, 2, 6, 3, 7)
        return np.ascontiguousarray(out.reshape(b, c.out_channels, t, h, w))


class VideoDiTIgnoredTimeEmbedder(VideoDiT):
    """Declares ``time_embedder`` as ignored by hsdp; it stays float32 whatever ``dtype`` is."""

    _hsdp_ignored_modules: ClassVar[list[str]] = ["time_embedder"]
    _time_embedder_dtype: ClassVar[DType | None] = float32


# -- weights and inputs ---------------------------------------------------------------------


def _param_rng(seed: int, name: str) -> np.random.Generator:
    # One stream per parameter name: a parameter's values do not depend on which others are
    # meta, so a streaming loader can fill one block at a time and get the full model's values.
    return np.random.default_rng([int(seed), zlib.crc32(name.encode())])


def _fan_in(module: Module) -> int | None:
    w = module._parameters.get("weight")
    return None if w is None or w.ndim < 2 else math.prod(w.shape[1:])


def _init_value(rng: np.random.Generator, leaf: str, p: Parameter, fan_in: int | None) -> np.ndarray:
    dt = p.dtype
    if dt.name == "bool":
        return rng.random(p.shape) < 0.5
    if not dt.is_floating_point:
        info = np.iinfo(dt.compute)
        return rng.integers(max(-127, info.min), min(127, info.max), size=p.shape, endpoint=True)
    if p.ndim == 0:
        # A dequantisation scale: int weights in [-127, 127] times it give ~U(+-1/sqrt(fan_in)).
        return np.asarray(rng.uniform(0.5, 1.0) / (127.0 * math.sqrt(fan_in or 1)), dtype=np.float32)
    if leaf == "weight" and p.ndim == 1:
        return np.ones(p.shape, dtype=np.float32)  # norm weights
    if leaf == "weight":
        bound = 1.0 / math.sqrt(math.prod(p.shape[1:]))
        return rng.uniform(-bound, bound, size=p.shape).astype(np.float32)
    return (0.02 * rng.standard_normal(p.shape)).astype(np.float32)  # biases, modulations


def init_weights(model: Module, seed: int = 0, *, prefix: str = "") -> Module:
    """Fill every parameter that has data with deterministic values; meta and sharded ones
    are skipped. Each parameter's values depend only on ``seed`` and its full name
    (``prefix`` + its name in ``model``), so ``init_weights(model.blocks[0], seed,
    prefix="blocks.0")`` reproduces that block's values from a whole-model init."""
    seen: set[Parameter] = set()
    for mod_name, module in model.named_modules(prefix=prefix):
        fan_in = _fan_in(module)
        for leaf, p in module._parameters.items():
            if p is None or p in seen:
                continue
            seen.add(p)
            if p._data is None:
                continue
            full = f"{mod_name}.{leaf}" if mod_name else leaf
            p.data = _init_value(_param_rng(seed, full), leaf, p, fan_in)
    return model


def _variants() -> dict[str, type[VideoDiT]]:
    from .quant import VideoDiTQuantized  # quant builds on this module

    return {"plain": VideoDiT, "ignored": VideoDiTIgnoredTimeEmbedder, "quantized": VideoDiTQuantized}


VARIANTS: tuple[str, ...] = ("plain", "ignored", "quantized")


def make_model(
    preset: str | DiTConfig = "tiny", variant: str = "plain", seed: int = 0, dtype: Any = float32
) -> VideoDiT:
    """Build a model; initialise it with ``init_weights(model, seed)`` unless under meta_init."""
    config = preset if isinstance(preset, DiTConfig) else DiTConfig.preset(preset)
    classes = _variants()
    if variant not in classes:
        raise ValueError(f"unknown model variant {variant!r}; known variants: {', '.join(classes)}")
    model = classes[variant](config, dtype=dtype)
    if not is_meta_init():
        init_weights(model, seed)
    return model


def make_inputs(
    config: str | DiTConfig,
    batch: int = 1,
    frames: int = 2,
    height: int = 8,
    width: int = 8,
    text_len: int = 8,
    seed: int = 1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Deterministic (x, timestep, context), float32, for a model of this config."""
    c = config if isinstance(config, DiTConfig) else DiTConfig.preset(config)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, c.in_channels, frames, height, width)).astype(np.float32)
    timestep = rng.uniform(0.0, 1000.0, size=batch).astype(np.float32)
    context = rng.standard_normal((batch, text_len, c.text_dim)).astype(np.float32)
    return x, timestep, context


def param_nbytes(model: Module) -> int:
    """Logical bytes of all parameters (storage dtype sizes, meta ones included)."""
    return sum(p.nbytes for p in model.parameters())


__all__ = [
    "DiTConfig",
    "PRESETS",
    "preset_names",
    "is_block",
    "Attention",
    "DiTBlock",
    "VideoDiT",
    "VideoDiTIgnoredTimeEmbedder",
    "timestep_embedding",
    "init_weights",
    "make_model",
    "make_inputs",
    "param_nbytes",
    "VARIANTS",
]
