"""One rank of the pipeline checks (started by tests/test_pipelines.py under mpiexec).

`python tests/pipelines_worker.py WAN22_DIR FLUX_DIR [KIND=DIR...] CASE...`: each case loads a tiny
pipeline with hsdp.pipelines.load_pipeline under one DiffusionParallelConfig, runs the stock
pipeline call through hsdp.pipelines.generate, and compares rank 0's float32 frames with the
stock unsharded diffusers pipeline loaded from the same folder (max abs <= 1e-4 on [0, 1]).
Each rank also checks that every sharded component holds 1/S of its elements and, with CFG
parallel, that it ran one transformer forward per step instead of two.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

import hsdp
import hsdp.pipelines as hp
from hsdp.engine.config import DiffusionParallelConfig

torch.set_num_threads(1)
STEPS = 4
WAN_CALL = dict(prompt="a cat running in the snow", negative_prompt="blurry low quality", height=32, width=32,
                num_frames=5, num_inference_steps=STEPS, guidance_scale=4.0, max_sequence_length=16)
LTX_CALL = dict(prompt="a boat on a lake", negative_prompt="blurry", height=32, width=32, num_frames=9,
                num_inference_steps=3, guidance_scale=3.0, max_sequence_length=16)
FLUX_CALL = dict(prompt="a red car on a street", negative_prompt="blurry", height=32, width=32,
                 num_inference_steps=3, true_cfg_scale=4.0, guidance_scale=3.5, max_sequence_length=16)
_references: dict[str, np.ndarray] = {}


def _frames(out: Any) -> np.ndarray:
    return out.frames if hasattr(out, "frames") else out.images


def reference(kind: str, path: str) -> np.ndarray:
    """The stock unsharded pipeline's float32 output (rank 0 only; computed once per kind)."""
    if kind not in _references:
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(path, dtype=torch.float32)
        if kind.endswith("-tiled"):
            tile(pipe.vae)
        call = _call(kind)
        _references[kind] = _frames(pipe(**call, generator=torch.Generator().manual_seed(0), output_type="np"))
    return _references[kind]


def _call(kind: str) -> dict[str, Any]:
    calls = {"wan22": WAN_CALL, "flux": FLUX_CALL, "flux-odd": dict(FLUX_CALL, **ODD), "ltx": LTX_CALL,
             "wan22-tiled": dict(WAN_CALL, **TILED_CALL), "flux-tiled": dict(FLUX_CALL, num_inference_steps=2),
             "wan22-i2v-tiled": dict(WAN_CALL, **TILED_CALL, image=_image()),
             "ltx-tiled": dict(LTX_CALL, num_inference_steps=2)}
    return calls[kind]


def _image() -> Any:
    from PIL import Image

    pixels = (np.random.default_rng(0).random((48, 80, 3)) * 255).astype(np.uint8)
    return Image.fromarray(pixels)


def count_forwards(pipe: Any) -> dict[str, list[int]]:
    counts: dict[str, list[int]] = {}
    for name in ("transformer", "transformer_2"):
        model = getattr(pipe, name, None)
        if model is not None:
            counts[name] = c = [0]
            model.register_forward_pre_hook(lambda *a, c=c: c.__setitem__(0, c[0] + 1))
    return counts


def check_shares(pipe: Any, config: DiffusionParallelConfig) -> None:
    state = hp.pipeline_state(pipe)
    expect = {"transformer", "transformer_2", "text_encoder", "text_encoder_2"} & set(state.components)
    assert set(state.sharded) == expect, (state.sharded, expect)
    s = config.hsdp_shard_size
    shares = np.zeros(1, dtype=np.int64)
    for name in state.sharded:
        c = state.components[name]
        # 1/S of the elements, give or take each unit's padding (its buffer is padded to a
        # multiple of 64 * S bytes: 16 * S float32 elements) and the padding before each
        # parameter of 256 bytes or more (at most 63 elements; a tiny model's units have few)
        assert abs(c.local_elements - c.elements / s) <= (16 * s + 63 * 4) * c.units, (name, c)
        shares[0] = c.local_elements
        every = np.zeros(state.world_size, dtype=np.int64)
        hsdp.distributed.get_world_group().all_gather(shares, every)
        assert every.sum() == c.elements * config.hsdp_replicate_size, (name, every, c.elements)
    vae = state.components["vae"]
    assert not vae.sharded and vae.local_elements == vae.elements


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "wan22-1x2": ("wan22", dict(use_hsdp=True, hsdp_shard_size=2)),
    "wan22-ulysses2": ("wan22", dict(use_hsdp=True, ulysses_degree=2)),
    "wan22-cfg2": ("wan22", dict(use_hsdp=True, cfg_parallel_size=2)),
    "flux-1x2": ("flux", dict(use_hsdp=True, hsdp_shard_size=2)),
    "flux-cfg2": ("flux", dict(use_hsdp=True, cfg_parallel_size=2)),  # true CFG, split
    "wan22-2x2": ("wan22", dict(use_hsdp=True, hsdp_shard_size=2, hsdp_replicate_size=2)),
    "wan22-ulysses2-cfg2": ("wan22", dict(use_hsdp=True, ulysses_degree=2, cfg_parallel_size=2)),
    "wan22-ulysses2-ring2": ("wan22", dict(use_hsdp=True, ulysses_degree=2, ring_degree=2)),  # USP
    # Flux through its context-parallel plan; "-odd": 36 px, 81 image tokens, split unevenly
    "flux-ulysses2-odd": ("flux", dict(use_hsdp=True, ulysses_degree=2)),
    "flux-ring2-odd": ("flux", dict(use_hsdp=True, ring_degree=2)),
    "flux-ulysses2-ring2": ("flux", dict(use_hsdp=True, ulysses_degree=2, ring_degree=2)),
    "flux-ulysses2-cfg2": ("flux", dict(use_hsdp=True, ulysses_degree=2, cfg_parallel_size=2)),
    # LTX-Video: the text split too, its padding mask gathered along the keys
    "ltx-ulysses2": ("ltx", dict(use_hsdp=True, ulysses_degree=2)),
    "ltx-ring2": ("ltx", dict(use_hsdp=True, ring_degree=2)),  # the mask's key blocks travel the ring
    # the VAE's tiles over 2 ranks, against the stock pipeline tiled the same way (-tiled: small tiles)
    "wan22-vae2-tiled": ("wan22", dict(use_hsdp=True, hsdp_shard_size=2, vae_patch_parallel_size=2)),
    "wan22-ulysses2-vae2-tiled": ("wan22", dict(use_hsdp=True, ulysses_degree=2, vae_patch_parallel_size=2)),
    "wan22-i2v-vae2-tiled": ("wan22-i2v", dict(use_hsdp=True, hsdp_shard_size=2, vae_patch_parallel_size=2)),
    "flux-vae2-tiled": ("flux", dict(use_hsdp=True, hsdp_shard_size=2, vae_patch_parallel_size=2)),
    "ltx-vae2-tiled": ("ltx", dict(use_hsdp=True, hsdp_shard_size=2, vae_patch_parallel_size=2)),
}
# Tiles small enough that the tiny folders have several: Wan 48 x 80 px -> 3 x 5 = 15 tiles (odd: uneven
# over 2 ranks); Flux 32 x 32 px -> 3 x 3 = 9
WAN_TILES = dict(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=16,
                 tile_sample_stride_width=16)
FLUX_TILES = dict(tile_sample_min_size=16, tile_latent_min_size=8)
LTX_TILES = dict(tile_sample_min_height=16, tile_sample_min_width=16, tile_sample_stride_height=8,
                 tile_sample_stride_width=8)  # 32 x 32 px, 4x spatial: 4 x 4 = 16 tiles
TILED_CALL = dict(height=48, width=80, num_inference_steps=2)  # the VAE is what is checked


def tile(vae: Any) -> None:
    """The test's tile sizes on a VAE (what a user sets after load_pipeline)."""
    if type(vae).__name__ == "AutoencoderKL":  # its enable_tiling takes no sizes: the attributes
        vae.enable_tiling()
        for name, value in FLUX_TILES.items():
            setattr(vae, name, value)
    else:
        vae.enable_tiling(**(LTX_TILES if "LTX" in type(vae).__name__ else WAN_TILES))
ODD = dict(height=36, width=36)  # Flux: 9 x 9 packed latent patches


def run_case(case: str, paths: dict[str, str]) -> None:
    kind, fields = CASES[case]
    config = DiffusionParallelConfig(**fields)
    rank = hsdp.distributed.get_rank()
    pipe = hp.load_pipeline(paths[kind], config, torch_dtype=torch.float32, progress=False)
    check_shares(pipe, config)
    counts = count_forwards(pipe)
    variant = kind + "-odd" if case.endswith("-odd") else kind + "-tiled" if case.endswith("-tiled") else kind
    if case.endswith("-tiled"):
        tile(pipe.vae)
    call = _call(variant)
    out = hp.generate(pipe, **call, generator=torch.Generator().manual_seed(0), output_type="np")
    steps = call["num_inference_steps"]
    forwards = sum(c[0] for c in counts.values())
    # two calls per guided step (LTX: one call, both branches in its batch); CFG parallel: one per rank
    per_step = 1 if kind == "ltx" or config.cfg_parallel_size == 2 else 2
    assert forwards == per_step * steps, (case, counts)
    if kind.startswith("wan22"):
        assert all(c[0] > 0 for c in counts.values()), f"{case}: an expert never ran: {counts}"
    if config.vae_patch_parallel_size > 1:  # every VAE rank decoded its share of several tiles
        spread = hp.pipeline_state(pipe).vae
        assert spread.last["tiles"] > config.vae_patch_parallel_size, (case, spread.last)
        if "i2v" in kind:  # and the image's encode too
            assert spread.last_encode["tiles"] > config.vae_patch_parallel_size, (case, spread.last_encode)
    if config.sequence_parallel_size > 1:  # the attention really ran over the split sequence
        routed = [m._hsdp_sequence_parallel.attention.calls for m in (pipe.transformer, pipe.transformer_2 if
                  getattr(pipe, "transformer_2", None) is not None else pipe.transformer)]
        assert all(routed), (case, routed)
    split = hp.pipeline_state(pipe).cfg_split
    assert (split.steps if split else 0) == (steps if config.cfg_parallel_size == 2 else 0)
    if rank != 0:
        assert out is None
    else:
        got, ref = _frames(out), reference(variant, paths[kind])
        diff = float(np.abs(got - ref).max())
        assert got.shape == ref.shape and diff <= 1e-4, (case, got.shape, ref.shape, diff)
        print(f"{case}: max abs {diff:.3g}", flush=True)
    print(f"rank {rank}: {case} ok", flush=True)


def run_bf16(paths: dict[str, str]) -> None:
    config = DiffusionParallelConfig(use_hsdp=True, hsdp_shard_size=2)
    pipe = hp.load_pipeline(paths["wan22"], config, torch_dtype=torch.bfloat16, progress=False)
    assert pipe.transformer.dtype == torch.bfloat16 and pipe.text_encoder.dtype == torch.bfloat16
    out = hp.generate(pipe, **WAN_CALL, generator=torch.Generator().manual_seed(0), output_type="np")
    if hsdp.distributed.get_rank() == 0:
        frames = out.frames
        assert frames.shape == (1, 5, 32, 32, 3) and np.isfinite(frames).all(), frames.shape
        assert 0.0 <= frames.min() and frames.max() <= 1.0 and frames.std() > 0
    print(f"rank {hsdp.distributed.get_rank()}: bf16 ok", flush=True)


def run_bad_folder_on_one_rank(paths: dict[str, str]) -> None:
    """Rank 1 is handed a folder that is no pipeline: every rank raises, none waits."""
    rank = hsdp.distributed.get_rank()
    path = paths["wan22"] if rank == 0 else paths["wan22"] + "/transformer"
    try:
        hp.load_pipeline(path, DiffusionParallelConfig(use_hsdp=True, hsdp_shard_size=2), progress=False)
    except (ValueError, RuntimeError) as exc:
        assert "model_index.json" in str(exc) and (rank == 1 or "rank 1" in str(exc)), str(exc)
        print(f"rank {rank}: bad folder ok", flush=True)
        return
    raise AssertionError("load_pipeline took a folder that is no pipeline")


def main() -> None:
    paths = {"wan22": sys.argv[1], "flux": sys.argv[2]}
    cases = [a for a in sys.argv[3:] if "=" not in a]
    paths.update(a.split("=", 1) for a in sys.argv[3:] if "=" in a)  # KIND=DIR: more folders
    hsdp.distributed.init_process_group()
    for case in cases:
        if case == "bf16":
            run_bf16(paths)
        elif case == "bad-folder":
            run_bad_folder_on_one_rank(paths)
        else:
            run_case(case, paths)


if __name__ == "__main__":
    main()
