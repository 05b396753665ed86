"""hsdp.testing.tiny_pipeline: the transformer's heads, layers and head dim as options (in the
saved configs, bad values refused by name), the defaults as before, and the ``ltx`` kind
(LTXPipeline) saved, loaded back by stock diffusers and run end to end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")  # torch is an optional dependency; make test installs it
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from hsdp.testing.tiny_pipeline import (  # noqa: E402
    build_tiny_pipeline,
    flux_axes_dims_rope,
    main,
    make_tiny_pipeline,
)


def _config(folder: Path, model: str = "transformer") -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads((folder / model / "config.json").read_text())
    return cfg


# FluxTransformer2DModel's config.json as the default flux folder had it before heads/layers/dim existed
FLUX_DEFAULT = {
    "_class_name": "FluxTransformer2DModel", "attention_head_dim": 16, "axes_dims_rope": [4, 6, 6],
    "guidance_embeds": True, "in_channels": 16, "joint_attention_dim": 32, "num_attention_heads": 2,
    "num_layers": 2, "num_single_layers": 2, "out_channels": None, "patch_size": 1, "pooled_projection_dim": 32,
}


def test_defaults_are_unchanged():
    """None is today's construction: the same configs, and the same weights as the defaults spelled out."""
    flux = build_tiny_pipeline("flux")
    cfg = {k: v for k, v in dict(flux.transformer.config).items() if not k.startswith("_")}
    want = {k: v for k, v in FLUX_DEFAULT.items() if not k.startswith("_")}
    assert {**cfg, "axes_dims_rope": list(cfg["axes_dims_rope"])} == want
    explicit = build_tiny_pipeline("flux", heads=2, layers=2, dim=16)
    for name in ("transformer", "text_encoder", "text_encoder_2", "vae"):
        a, b = getattr(flux, name).state_dict(), getattr(explicit, name).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name

    wan = build_tiny_pipeline("wan22")
    for model, layers in (("transformer", 3), ("transformer_2", 2)):
        c = getattr(wan, model).config
        assert (c.num_attention_heads, c.attention_head_dim, c.num_layers) == (2, 16, layers)
    explicit = build_tiny_pipeline("wan22", heads=2, layers=3, dim=16)
    a, b = wan.transformer_2.state_dict(), explicit.transformer_2.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)

    c = build_tiny_pipeline("ltx").transformer.config
    assert (c.num_attention_heads, c.attention_head_dim, c.num_layers, c.cross_attention_dim) == (2, 16, 2, 32)


def test_heads_layers_dim_in_the_saved_configs(tmp_path):
    flux = _config(make_tiny_pipeline(tmp_path / "flux", "flux", heads=3, layers=1, dim=24))
    assert (flux["num_attention_heads"], flux["attention_head_dim"]) == (3, 24)
    assert (flux["num_layers"], flux["num_single_layers"], flux["axes_dims_rope"]) == (1, 1, [4, 10, 10])

    wan = make_tiny_pipeline(tmp_path / "wan22", "wan22", heads=4, layers=4, dim=8)
    for model, layers in (("transformer", 4), ("transformer_2", 3)):  # the second expert one block fewer
        c = _config(wan, model)
        assert (c["num_attention_heads"], c["attention_head_dim"], c["num_layers"]) == (4, 8, layers)
    one = make_tiny_pipeline(tmp_path / "wan22-1", "wan22", layers=1)
    assert _config(one)["num_layers"] == _config(one, "transformer_2")["num_layers"] == 1

    # the command line, as a shell would run it
    assert main([str(tmp_path / "ltx"), "--kind", "ltx", "--heads", "3", "--layers", "4", "--dim", "10"]) == 0
    ltx = _config(tmp_path / "ltx")
    assert ltx["_class_name"] == "LTXVideoTransformer3DModel"
    assert (ltx["num_attention_heads"], ltx["attention_head_dim"], ltx["num_layers"]) == (3, 10, 4)
    assert ltx["cross_attention_dim"] == 30  # the caption is projected to heads * dim


def test_flux_rope_axes_follow_the_head_dim():
    assert flux_axes_dims_rope(16) == (4, 6, 6)  # the default folder's
    assert flux_axes_dims_rope(128) == (16, 56, 56)  # the real Flux's
    for dim in range(6, 200, 2):
        axes = flux_axes_dims_rope(dim)
        assert sum(axes) == dim and all(a >= 2 and a % 2 == 0 for a in axes), (dim, axes)


@pytest.mark.parametrize("kind, kwargs, message", [
    ("flux", {"heads": 0}, "heads must be a positive int, not 0"),
    ("wan22", {"layers": -1}, "layers must be a positive int, not -1"),
    ("ltx", {"dim": 8.0}, "dim must be a positive int, not 8.0"),
    ("flux", {"heads": True}, "heads must be a positive int, not True"),
    ("flux", {"dim": 15}, "flux dim=15: .* dim must be even and at least 6"),
    ("flux", {"dim": 4}, "flux dim=4: .* dim must be even and at least 6"),
    ("wan", {"dim": 15}, "wan dim=15: .* dim must be even"),
    ("wan22-i2v", {"dim": 7}, "wan22-i2v dim=7: .* dim must be even"),
    ("ltx", {"heads": 3, "dim": 3}, "ltx heads=3, dim=3: .* heads \\* dim must be even and at least 6, not 9"),
    ("ltx", {"heads": 1, "dim": 4}, "ltx heads=1, dim=4: .* heads \\* dim must be even and at least 6, not 4"),
    ("sd3", {}, "kind 'sd3' is not one of wan, wan22, wan22-i2v, flux, ltx"),
])
def test_bad_values_are_refused_by_name(kind, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_tiny_pipeline(kind, **kwargs)


def test_bad_value_on_the_command_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "x"), "--kind", "flux", "--dim", "9"])
    assert e.value.code == 2 and "dim must be even and at least 6" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_ltx_saved_loads_back_and_runs_end_to_end(tmp_path):
    """The ltx folder loads with stock diffusers as LTXPipeline (a transformer with a _cp_plan)
    and generates at the smallest size the pipeline allows, with its default CFG and 128 text
    tokens, the same frames as the pipeline object before saving."""
    import numpy as np
    from diffusers import DiffusionPipeline, LTXPipeline

    path = make_tiny_pipeline(tmp_path / "ltx", "ltx", seed=0)
    for model in ("transformer", "text_encoder"):  # each over 2+ files, so a loader takes the index path
        assert len(list((path / model).glob("*.safetensors"))) >= 2, model
    pipe = DiffusionPipeline.from_pretrained(path)
    assert type(pipe) is LTXPipeline and type(pipe.transformer)._cp_plan
    assert (pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio) == (4, 4)
    call = {"prompt": "a cat", "negative_prompt": "blurry", "num_inference_steps": 2, "height": 32, "width": 32,
            "num_frames": 9, "output_type": "np"}
    frames = pipe(**call, generator=torch.Generator().manual_seed(0)).frames
    assert frames.shape == (1, 9, 32, 32, 3) and np.isfinite(frames).all()
    assert frames.min() >= 0 and frames.max() <= 1 and frames.std() > 0
    ref = build_tiny_pipeline("ltx", seed=0)(**call, generator=torch.Generator().manual_seed(0)).frames
    assert np.abs(frames - ref).max() <= 1e-6
    wide = pipe(**dict(call, width=64, num_frames=5), generator=torch.Generator().manual_seed(0)).frames
    assert wide.shape == (1, 5, 32, 64, 3) and np.isfinite(wide).all()
