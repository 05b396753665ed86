"""Stock diffusers models at tiny sizes with random weights, their inputs, and the unsharded
reference hsdp must equal: the same model with each parameter cast to the dtype hsdp stores
it in, and floating forward inputs cast the way cast_forward_inputs casts them (nested too,
as FSDP2 does), at the root and at every unit. Imported by the torch tests and their
multi-rank worker."""

from __future__ import annotations

from typing import Any, Callable

import torch


def is_wan_block(name: str, module: Any) -> bool:
    return name.startswith("blocks.") and name.count(".") == 1


def is_flux_block(name: str, module: Any) -> bool:
    return name.split(".")[0] in ("transformer_blocks", "single_transformer_blocks") and name.count(".") == 1


def make_wan(seed: int = 0, layers: int = 3) -> Any:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    ).eval()


def wan_inputs(seed: int = 1) -> tuple[tuple[Any, ...], dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 4, 2, 8, 8, generator=g)
    ctx = torch.randn(1, 8, 32, generator=g)
    return (x, torch.tensor([500]), ctx), {"return_dict": False}


def make_flux(seed: int = 0) -> Any:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6),
    ).eval()


def flux_inputs(seed: int = 1) -> tuple[tuple[Any, ...], dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    kw = {
        "hidden_states": torch.randn(1, 16, 4, generator=g),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=g),
        "pooled_projections": torch.randn(1, 32, generator=g),
        "timestep": torch.tensor([0.5]),
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(8, 3),
        "return_dict": False,
    }
    return (), kw


MODELS: dict[str, tuple[Callable[..., Any], Callable[..., Any], Callable[[str, Any], bool]]] = {
    "wan": (make_wan, wan_inputs, is_wan_block),
    "flux": (make_flux, flux_inputs, is_flux_block),
}


def _cast(v: Any, dt: torch.dtype) -> Any:
    if isinstance(v, (tuple, list)):
        return type(v)(_cast(x, dt) for x in v)
    if isinstance(v, dict):
        return {k: _cast(x, dt) for k, x in v.items()}
    return v.to(dt) if torch.is_tensor(v) and v.is_floating_point() else v


def reference(kind: str, param_dtype: str | None, seed: int = 0) -> Any:
    """The unsharded model hsdp's sharded one must equal bit for bit."""
    make, _, cond = MODELS[kind]
    ref = make(seed)
    if param_dtype is None or param_dtype == "float32":
        return ref
    dt = getattr(torch, param_dtype)
    keep = set(getattr(ref, "_keep_in_fp32_modules", None) or ())
    for n, p in ref.named_parameters():
        if p.ndim > 0 and p.is_floating_point() and keep.isdisjoint(n.split(".")):
            p.data = p.data.to(dt)

    def pre(module: Any, args: Any, kwargs: Any) -> Any:
        return _cast(args, dt), _cast(kwargs, dt)

    ref.register_forward_pre_hook(pre, with_kwargs=True)
    for n, m in ref.named_modules():
        if n and cond(n, m):
            m.register_forward_pre_hook(pre, with_kwargs=True)
    return ref


def run(model: Any, kind: str) -> torch.Tensor:
    args, kwargs = MODELS[kind][1]()
    with torch.inference_mode():
        return model(*args, **kwargs)[0]
