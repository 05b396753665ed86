"""What ``hsdp generate`` needs to know about a diffusers pipeline folder, read from its JSON
files alone (no torch, no weights), so that a bad folder or a size the model cannot take is
refused before any rank loads anything."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["FolderError", "PipelineFolder", "SUPPORTED_CLASSES", "read_folder"]

Output = Literal["video", "image"]

# The pipeline classes the command drives: what they make, and whether they take an image.
SUPPORTED_CLASSES: dict[str, tuple[Output, bool]] = {
    "WanPipeline": ("video", False),
    "WanImageToVideoPipeline": ("video", True),
    "FluxPipeline": ("image", False),
}


class FolderError(ValueError):
    """The folder is not a pipeline this command can run; the message says what is wrong."""


@dataclass(frozen=True)
class PipelineFolder:
    path: Path
    class_name: str
    output: Output  # "video" or "image"
    takes_image: bool  # image-to-video
    spatial_multiple: int  # height and width must be multiples of this (VAE x patch)
    temporal_factor: int | None  # num_frames - 1 must be a multiple of this (video models)
    heads: tuple[tuple[str, int], ...] = ()  # each transformer's num_attention_heads, from its config.json
    # each transformer listed (model_index.json): (component, library, class name)
    transformers: tuple[tuple[str, str, str], ...] = ()

    def describe_multiple(self) -> str:
        return f"{self.spatial_multiple} (the VAE's spatial factor x the transformer's patch)"

    def tokens(self, height: int, width: int, num_frames: int | None) -> int:
        """The transformer's image (video) tokens for these sizes: the sequence that sequence
        parallel splits."""
        frames = 1 if self.temporal_factor is None or num_frames is None else (num_frames - 1) // self.temporal_factor + 1
        return frames * (height // self.spatial_multiple) * (width // self.spatial_multiple)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise FolderError(f"cannot read {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise FolderError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise FolderError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _component_config(root: Path, index: dict[str, Any], name: str) -> dict[str, Any] | None:
    """``NAME/config.json`` of a component model_index.json lists (None when it lists it as
    absent, ``[null, null]``, as Wan2.2 does for an unused transformer)."""
    entry = index.get(name)
    if not isinstance(entry, list) or len(entry) != 2 or entry[0] is None:
        return None
    path = root / name / "config.json"
    if not path.is_file():
        raise FolderError(f"{root}/model_index.json lists the component {name!r}, but {path} is missing")
    return _read_json(path)


def _patch(config: dict[str, Any], name: str, path: Path) -> int:
    patch = config.get("patch_size", 1)
    value = patch[1] if isinstance(patch, list) else patch
    if not isinstance(value, int) or value < 1:
        raise FolderError(f"{path}/{name}/config.json: patch_size {patch!r} is not understood")
    return value


def read_folder(path: str | Path) -> PipelineFolder:
    """Checks ``path`` is a diffusers pipeline folder of a supported class; FolderError if not."""
    root = Path(path)
    if not root.exists():
        raise FolderError(f"--model {root}: no such folder")
    if not root.is_dir():
        raise FolderError(f"--model {root}: not a folder (a diffusers pipeline folder, as save_pretrained writes)")
    index_path = root / "model_index.json"
    if not index_path.is_file():
        raise FolderError(
            f"--model {root}: not a diffusers pipeline folder (no model_index.json); make one with "
            "`python -m hsdp.testing.tiny_pipeline DIR --kind wan22` or a pipeline's save_pretrained"
        )
    index = _read_json(index_path)
    class_name = index.get("_class_name")
    if class_name not in SUPPORTED_CLASSES:
        raise FolderError(
            f"--model {root}: pipeline class {class_name!r} (model_index.json) is not one hsdp generate runs; "
            f"supported: {', '.join(SUPPORTED_CLASSES)}"
        )
    output, takes_image = SUPPORTED_CLASSES[class_name]
    vae = _component_config(root, index, "vae")
    if vae is None:
        raise FolderError(f"--model {root}: model_index.json lists no vae")
    transformers = [c for c in (_component_config(root, index, n) for n in ("transformer", "transformer_2")) if c]
    if not transformers:
        raise FolderError(f"--model {root}: model_index.json lists no transformer")
    patch = _patch(transformers[0], "transformer", root)
    heads = tuple((name, c["num_attention_heads"]) for name in ("transformer", "transformer_2")
                  if (c := _component_config(root, index, name)) and isinstance(c.get("num_attention_heads"), int))
    if class_name.startswith("Wan"):
        spatial = int(vae.get("scale_factor_spatial", 8))
        temporal: int | None = int(vae.get("scale_factor_temporal", 4))
    else:  # Flux: the VAE halves the size per level after the first, latents are packed 2 x 2
        spatial = 2 ** (len(vae.get("block_out_channels", [0, 0, 0, 0])) - 1)
        patch = 2
        temporal = None
    listed = tuple((name, str(index[name][0]), str(index[name][1])) for name in ("transformer", "transformer_2")
                   if _component_config(root, index, name) is not None)
    return PipelineFolder(root, class_name, output, takes_image, spatial * patch, temporal, heads, listed)
