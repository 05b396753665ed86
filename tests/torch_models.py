"""Stock diffusers models at tiny sizes with random weights, their inputs, and the unsharded
reference hsdp must equal (hsdp.adapters.torch.unsharded_reference: each parameter in the
dtype hsdp stores it in, floating inputs cast at the root and at every unit). Imported by
the torch tests and their multi-rank worker."""

from __future__ import annotations

from typing import Any, Callable

import torch


def worker_world() -> Any:
    """The world a worker runs on: HSDP_TEST_BACKEND's (tests/mpirun.py FAKEDEV), else "auto"."""
    import os

    import hsdp

    return hsdp.distributed.init_process_group(os.environ.get("HSDP_TEST_BACKEND", "auto"))


def target_device(world: Any) -> str | None:
    """Where a worker puts its sharded model: the device type the world's device is viewed as,
    when its backend has a device (fakedev: 'cpu', its buffers then on the fake device), else
    None (host buffers), as the C core's device_info says."""
    import hsdp

    info = hsdp.world.devices.of_group(world)
    return info.framework if info.on_device else None


def check_on_device(world: Any, model: Any) -> None:
    """On a backend with a device, every unit's buffers are that device's."""
    import hsdp

    info = hsdp.world.devices.of_group(world)
    if info.on_device:
        got = {u.unit.device for u in hsdp.get_units(model)}
        assert got == {info.device}, (got, info)


def is_wan_block(name: str, module: Any) -> bool:
    return name.startswith("blocks.") and name.count(".") == 1


def is_time_embedder(name: str, module: Any) -> bool:
    return name == "condition_embedder.time_embedder"  # in Wan's _keep_in_fp32_modules


def is_linear(name: str, module: Any) -> bool:
    return isinstance(module, torch.nn.Linear)


def is_wan_block_or_linear(name: str, module: Any) -> bool:
    """Wan's blocks and every nn.Linear: units inside units, some of them (the time
    embedder's) inside _keep_in_fp32_modules, so float32 in a bfloat16 model."""
    return is_wan_block(name, module) or is_linear(name, module)


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


def make_wan_wide(seed: int = 0) -> Any:
    """A Wan whose blocks are wide enough (dim 128, ffn 512) for the per-block scales and the
    float32 time embedder to weigh what they do in a real one: the float8 wire's memory test."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=512, num_layers=4, cross_attn_norm=True,
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
    "wan-kept": (make_wan, wan_inputs, is_wan_block_or_linear),
}


def reference(kind: str, param_dtype: str | None, seed: int = 0, conditions: list[Any] | None = None) -> Any:
    """The unsharded model hsdp's sharded one must equal bit for bit."""
    from hsdp.adapters.torch import unsharded_reference

    make, _, cond = MODELS[kind]
    ref = make(seed)
    ref._hsdp_shard_conditions = conditions or [cond]  # which modules' inputs the units cast
    return unsharded_reference(ref, param_dtype)


def run(model: Any, kind: str) -> torch.Tensor:
    args, kwargs = MODELS[kind][1]()
    with torch.inference_mode():
        return model(*args, **kwargs)[0]
