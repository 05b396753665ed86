"""The reference ``--verify`` compares with: the stock, unsharded pipeline from the same
folder, made to compute what hsdp's sharded pipeline computes in every dtype."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

__all__ = ["reference_pipeline"]


def reference_pipeline(folder: str | Path, pipe: Any, dtype: Any, device: str | None = None) -> Any:
    """The stock, unsharded pipeline from ``folder`` that computes what the sharded ``pipe``
    computes. In float32 that is ``DiffusionPipeline.from_pretrained`` as is. In a narrower
    dtype, each component ``pipe`` holds sharded is loaded in float32 and made by
    :func:`hsdp.adapters.torch.unsharded_reference` to store its weights as hsdp stores them
    and to cast its units' floating inputs as hsdp's hooks do (FSDP2's
    ``cast_forward_inputs``); the other components load as ``load_pipeline`` loads them. A VAE
    ``pipe`` tiles (``vae_patch_parallel_size``) is tiled the same way."""
    import diffusers
    import torch

    from hsdp.adapters.torch import unsharded_reference
    from hsdp.engine.dtypes import as_dtype
    from hsdp.pipelines import pipeline_state

    folder = Path(folder)
    index = json.loads((folder / "model_index.json").read_text(encoding="utf-8"))
    parts: dict[str, Any] = {}
    if dtype != torch.float32:
        for name in pipeline_state(pipe).sharded:
            library, class_name = index[name]
            cls = getattr(importlib.import_module(library), class_name)
            model = cls.from_pretrained(str(folder / name), dtype=torch.float32).eval()
            sharded = getattr(pipe, name)
            # the unit choice and the float32-kept modules load_pipeline set on its instance
            model._hsdp_shard_conditions = list(sharded._hsdp_shard_conditions)
            model._keep_in_fp32_modules = getattr(sharded, "_keep_in_fp32_modules", None)
            parts[name] = unsharded_reference(model, as_dtype(dtype).name)
    # the folder's own class: DiffusionPipeline.from_pretrained reloads some passed components
    stock = getattr(diffusers, index["_class_name"]).from_pretrained(str(folder), dtype=dtype, **parts)
    if device is not None:
        stock.to(device)
    _same_tiling(pipe, stock)
    return stock


def _same_tiling(pipe: Any, stock: Any) -> None:
    """The stock VAE tiled as ``pipe``'s (``vae_patch_parallel_size`` switches tiling on, and a
    tiled decode blends tiles: the reference must tile the same way)."""
    vae, ref = getattr(pipe, "vae", None), getattr(stock, "vae", None)
    if vae is None or ref is None or not getattr(vae, "use_tiling", False):
        return
    for name, value in vars(vae).items():  # the tile sizes, strides and overlaps enable_tiling set
        if name.startswith("tile_") or name == "use_tiling":
            setattr(ref, name, value)
