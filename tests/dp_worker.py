"""One rank of the data-parallel checks (started by tests/test_dp.py under mpiexec).

`python tests/dp_worker.py WAN22_DIR FLUX_DIR CASE...` (a case "collective:CASE" runs CASE with
every gather collective, HSDP_DIRECT_GATHER=0, and a 60 s collective timeout, so that a
control that desyncs fails fast): each case loads a tiny pipeline with
hsdp.pipelines.load_pipeline under DiffusionParallelConfig(data_parallel_size=D, use_hsdp=True,
...), runs a batch spread over the lanes, and compares every output (float32 frames, rank 0)
with the stock unsharded diffusers pipeline called with that output alone (max abs <= 1e-4 on
[0, 1]). Every rank also checks that each sharded component holds 1/S of its elements with S
spanning the lanes, and what the lanes' ballot did.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import numpy as np
import torch

import hsdp
import hsdp.pipelines as hp
from hsdp.engine.config import DiffusionParallelConfig
from hsdp.pipelines.lanes import run_lanes

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from pipelines_worker import FLUX_CALL, TILED_CALL, WAN_CALL, _frames, check_shares, tile  # noqa: E402

torch.set_num_threads(1)
PROMPTS = ["a cat running in the snow", "a red boat on a lake", "two dogs in a garden", "a kite over a field"]
_stock: dict[str, Any] = {}


def stock(kind: str, path: str, call: dict[str, Any], tiled: bool = False) -> np.ndarray:
    """The stock unsharded pipeline called with one output alone (rank 0); tiled: its VAE
    tiled as the test tiles it (pipelines_worker.tile)."""
    key = f"{path}-tiled" if tiled else path
    if key not in _stock:
        from diffusers import DiffusionPipeline

        _stock[key] = DiffusionPipeline.from_pretrained(path, dtype=torch.float32)
        if tiled:
            tile(_stock[key].vae)
    return _frames(_stock[key](**call, output_type="np"))


def compare(case: str, kind: str, path: str, got: np.ndarray, calls: list[dict[str, Any]],
            tiled: bool = False) -> None:
    assert got.shape[0] == len(calls), (case, got.shape, len(calls))
    for i, call in enumerate(calls):
        ref = stock(kind, path, call, tiled)
        diff = float(np.abs(got[i : i + 1] - ref).max())
        assert got[i : i + 1].shape == ref.shape and diff <= 1e-4, (case, i, got.shape, ref.shape, diff)
        print(f"{case}: output {i} max abs {diff:.3g}", flush=True)


def seeded(n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(10 + i) for i in range(n)]


def run_batch(case: str, kind: str, path: str, config: DiffusionParallelConfig, n: int) -> None:
    """n prompts through hp.generate: output i equals the stock pipeline with prompt i and
    generator i alone."""
    rank = hsdp.distributed.get_rank()
    pipe = hp.load_pipeline(path, config, torch_dtype=torch.float32, progress=False)
    check_shares(pipe, config)
    base = WAN_CALL if kind == "wan22" else FLUX_CALL
    tiled = config.vae_patch_parallel_size > 1
    if tiled:  # each lane's first ranks share its VAE's tiles
        tile(pipe.vae)
        base = {**base, **TILED_CALL}
    prompts = PROMPTS[:n]
    negs = [f"blurry {i}" for i in range(n)]
    out = hp.generate(pipe, **{**base, "prompt": prompts, "negative_prompt": negs}, generator=seeded(n),
                      output_type="np")
    ls = hp.pipeline_state(pipe).lockstep
    assert ls is not None and ls.ballots > 0, ls
    if rank == 0:
        calls = [{**base, "prompt": p, "negative_prompt": q, "generator": g}
                 for p, q, g in zip(prompts, negs, seeded(n), strict=True)]
        compare(case, kind, path, _frames(out), calls, tiled)
    else:
        assert out is None
    if tiled:
        spread = hp.pipeline_state(pipe).vae
        assert spread.group.size == 2 and spread.last["tiles"] > 2, spread.last  # one lane's ranks
    print(f"rank {rank}: {case} ok ({ls.report()})", flush=True)


def run_uneven(case: str, path: str, config: DiffusionParallelConfig, lockstep: bool = True) -> None:
    """Lanes in one round with different step counts (4 and 6: Wan 2.2's experts switch at
    different steps), guidance on one lane and off on the other, then a third output on lane 0
    alone (lane 1 serves it). Without the lockstep (the control) the lanes' gathers part ways
    and the agreement check fails every rank, naming what each asked for."""
    rank = hsdp.distributed.get_rank()
    pipe = hp.load_pipeline(path, config, torch_dtype=torch.float32, progress=False)
    if not lockstep:
        ls = hp.pipeline_state(pipe).lockstep
        for sched in ls.schedules:
            sched.lockstep = None
        object.__setattr__(pipe, "_hsdp", dataclasses.replace(hp.pipeline_state(pipe), lockstep=None))
    calls = [
        {**WAN_CALL, "prompt": PROMPTS[0], "num_inference_steps": 4, "guidance_scale": 4.0},
        {**WAN_CALL, "prompt": PROMPTS[1], "num_inference_steps": 6, "guidance_scale": 1.0},
        {**WAN_CALL, "prompt": PROMPTS[2], "num_inference_steps": 3, "guidance_scale": 4.0},
    ]
    for i, c in enumerate(calls):
        c["generator"] = torch.Generator().manual_seed(20 + i)
        c["output_type"] = "np"
    groups = hp.pipeline_state(pipe).groups
    world = hsdp.distributed.get_world_group()
    outputs, errors = run_lanes(pipe, calls, world, groups)
    if not lockstep:
        assert any(e is not None and "do not gather the same unit" in e for e in errors), errors
        print(f"rank {rank}: {case} ok (desync caught)", flush=True)
        return
    assert errors == [None] * len(calls), errors
    ls = hp.pipeline_state(pipe).lockstep
    assert ls.served_forwards > 0, ls.report()  # the lanes did wait for each other's models
    if rank == 0:
        got = np.concatenate([_frames(o) for o in outputs], axis=0)
        for i, c in enumerate(calls):
            c["generator"] = torch.Generator().manual_seed(20 + i)
            c.pop("output_type")
        compare(case, "wan22", path, got, calls)
    print(f"rank {rank}: {case} ok ({ls.report()})", flush=True)


def run_per_prompt_outputs(case: str, path: str) -> None:
    """num_videos_per_prompt=2 for 2 prompts on 2 lanes: outputs (p0, v0), (p0, v1), (p1, v0),
    (p1, v1), each equal to the stock pipeline with its prompt and generator alone."""
    rank = hsdp.distributed.get_rank()
    pipe = hp.load_pipeline(path, DiffusionParallelConfig(use_hsdp=True, data_parallel_size=2),
                            torch_dtype=torch.float32, progress=False)
    out = hp.generate(pipe, **{**WAN_CALL, "prompt": PROMPTS[:2]}, num_videos_per_prompt=2, generator=seeded(4),
                      output_type="np")
    if rank == 0:
        calls = [{**WAN_CALL, "prompt": PROMPTS[i // 2], "generator": g} for i, g in enumerate(seeded(4))]
        compare(case, "wan22", path, _frames(out), calls)
    print(f"rank {rank}: {case} ok", flush=True)


def run_image_to_video(case: str, path: str) -> None:
    """Wan 2.2 image to video: a list of images, one per prompt, split with the prompts."""
    import PIL.Image

    rank = hsdp.distributed.get_rank()
    pipe = hp.load_pipeline(path, DiffusionParallelConfig(use_hsdp=True, data_parallel_size=2),
                            torch_dtype=torch.float32, progress=False)
    images = [PIL.Image.fromarray(np.random.default_rng(i).integers(0, 255, (32, 32, 3), dtype=np.uint8))
              for i in range(2)]
    base = {**WAN_CALL, "prompt": PROMPTS[:2], "image": images}
    out = hp.generate(pipe, **base, generator=seeded(2), output_type="np")
    if rank == 0:
        calls = [{**WAN_CALL, "prompt": PROMPTS[i], "image": images[i], "generator": g}
                 for i, g in enumerate(seeded(2))]
        compare(case, "wan22", path, _frames(out), calls)
    print(f"rank {rank}: {case} ok", flush=True)


def run_refusals(path: str) -> None:
    """Bad input: a generator list of another length; one generator for a batch of several."""
    rank = hsdp.distributed.get_rank()
    config = DiffusionParallelConfig(use_hsdp=True, data_parallel_size=2)
    pipe = hp.load_pipeline(path, config, torch_dtype=torch.float32, progress=False)
    for kwargs, text in (
        ({"generator": seeded(3)}, "generator is a list of 3 generators, but the batch is 2"),
        ({"generator": torch.Generator().manual_seed(0)}, "give one generator per output"),
    ):
        try:
            hp.generate(pipe, **{**WAN_CALL, "prompt": PROMPTS[:2]}, **kwargs)
        except ValueError as exc:
            assert text in str(exc), str(exc)
        else:
            raise AssertionError(f"generate took {kwargs}")
    print(f"rank {rank}: refusals ok", flush=True)


def main() -> None:
    paths = {"wan22": sys.argv[1], "flux": sys.argv[2]}
    hsdp.distributed.init_process_group()
    world = hsdp.distributed.get_world_size()
    timeout, direct = hsdp.distributed.get_timeout(), os.environ.get("HSDP_DIRECT_GATHER")
    for label in sys.argv[3:]:
        case = label.removeprefix("collective:")
        if case != label:  # read at each unit's first gather; the same on every rank
            os.environ["HSDP_DIRECT_GATHER"] = "0"
            hsdp.distributed.set_timeout(60)
        else:  # the launch's own settings
            if direct is None:
                os.environ.pop("HSDP_DIRECT_GATHER", None)
            else:
                os.environ["HSDP_DIRECT_GATHER"] = direct
            hsdp.distributed.set_timeout(timeout)
        if case == "wan22-dp2":
            run_batch(label, "wan22", paths["wan22"], DiffusionParallelConfig(use_hsdp=True, data_parallel_size=2), 2)
        elif case == "wan22-dp2-3prompts":
            run_batch(label, "wan22", paths["wan22"], DiffusionParallelConfig(use_hsdp=True, data_parallel_size=2), 3)
        elif case == "flux-dp2":
            run_batch(label, "flux", paths["flux"], DiffusionParallelConfig(use_hsdp=True, data_parallel_size=2), 2)
        elif case == "wan22-uneven":
            run_uneven(label, paths["wan22"], DiffusionParallelConfig(use_hsdp=True, data_parallel_size=2))
        elif case == "wan22-uneven-no-lockstep":
            run_uneven(label, paths["wan22"], DiffusionParallelConfig(use_hsdp=True, data_parallel_size=2), False)
        elif case == "wan22-dp2-cfg2":
            assert world == 4
            run_batch(label, "wan22", paths["wan22"],
                      DiffusionParallelConfig(use_hsdp=True, data_parallel_size=2, cfg_parallel_size=2), 2)
        elif case == "wan22-dp2-ulysses2":
            assert world == 4
            run_batch(label, "wan22", paths["wan22"],
                      DiffusionParallelConfig(use_hsdp=True, data_parallel_size=2, ulysses_degree=2), 2)
        elif case == "wan22-dp2-ulysses2-vae2":  # each lane's VAE over its own 2 ranks
            assert world == 4
            run_batch(label, "wan22", paths["wan22"], DiffusionParallelConfig(
                use_hsdp=True, data_parallel_size=2, ulysses_degree=2, vae_patch_parallel_size=2), 2)
        elif case == "wan22-dp4-r2":  # 2 replica groups of 2 lanes: a ballot per shard group
            assert world == 4
            run_batch(label, "wan22", paths["wan22"],
                      DiffusionParallelConfig(use_hsdp=True, data_parallel_size=4, hsdp_replicate_size=2), 3)
        elif case == "refusals":
            run_refusals(paths["wan22"])
        elif case == "wan22-per-prompt":
            run_per_prompt_outputs(label, paths["wan22"])
        elif case == "wan22-i2v-dp2":
            run_image_to_video(label, os.environ["DP_I2V_DIR"])
        else:
            raise SystemExit(f"unknown case {case}")


if __name__ == "__main__":
    main()
