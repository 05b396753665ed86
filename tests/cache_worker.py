"""One rank of the step-cache checks (started by tests/test_cache.py under mpiexec).

`python tests/cache_worker.py WAN22_DIR CASE...`: each case loads the tiny Wan 2.2 folder with
hsdp.pipelines.load_pipeline under one DiffusionParallelConfig, enables a diffusers step cache
on both experts (``enable_cache``, as a user would after loading), runs the stock call through
hsdp.pipelines.generate, and compares rank 0's float32 frames and each expert's computed and
skipped forwards with the stock single-process pipeline under the same cache (max abs <= 1e-4).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import torch

import hsdp
import hsdp.pipelines as hp
from hsdp.engine.config import DiffusionParallelConfig
from hsdp.pipelines.cache import CacheWatch

torch.set_num_threads(1)
STEPS = 8
CALL = dict(negative_prompt="blurry low quality", height=32, width=48, num_frames=5, num_inference_steps=STEPS,
            guidance_scale=4.0, max_sequence_length=16, output_type="np")
PROMPTS = ["a cat running in the snow", "a red boat on a lake"]
# 0.2: some forwards skip, some compute, and under Ulysses 2 one rank's share alone would have
# decided otherwise in one forward (measured: 0.1-0.2 disagree, 0.25-0.3 do not)
FBC_THRESHOLD = float(os.environ.get("CACHE_FBC_THRESHOLD", "0.2"))
_stock: dict[str, Any] = {}


def cache_config(kind: str) -> Any:
    from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    if kind == "fbc":
        return FirstBlockCacheConfig(threshold=FBC_THRESHOLD)
    if kind == "taylor":
        from hsdp.cli.cache_spec import TAYLORSEER_MODULES

        return TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=2, max_order=1,
                                     cache_identifiers=list(TAYLORSEER_MODULES))
    if kind == "mag":  # ratios as a calibration would give them; decisions follow the step alone
        return MagCacheConfig(threshold=0.5, max_skip_steps=2, retention_ratio=0.25, num_inference_steps=STEPS,
                              mag_ratios=[1.0] + [0.9] * (STEPS - 1))
    raise SystemExit(f"unknown cache {kind}")


def experts(pipe: Any) -> list[tuple[str, Any]]:
    return [(n, getattr(pipe, n)) for n in ("transformer", "transformer_2") if getattr(pipe, n, None) is not None]


def stock(path: str, kind: str, prompt: str, seed: int) -> tuple[np.ndarray, dict[str, tuple[int, int]]]:
    """The stock single-process pipeline with the same cache (rank 0): frames and, per expert,
    (computed, skipped) forwards."""
    key = f"{kind}:{prompt}"
    if key not in _stock:
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(path, dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        for _, model in experts(pipe):
            model.enable_cache(cache_config(kind))
        watches = {n: CacheWatch(m, n, None, False) for n, m in experts(pipe)}
        frames = pipe(prompt=prompt, **CALL, generator=torch.Generator().manual_seed(seed)).frames
        _stock[key] = (frames, {n: (w.counts.computed, w.counts.skipped) for n, w in watches.items()})
    return _stock[key]


def run(case: str, path: str) -> None:
    kind, _, mode = case.partition("-")
    fields: dict[str, Any] = {
        "1x2": dict(use_hsdp=True, hsdp_shard_size=2),
        "ulysses2": dict(use_hsdp=True, ulysses_degree=2),
        "ulysses2-cfg2": dict(use_hsdp=True, ulysses_degree=2, cfg_parallel_size=2),
        "dp2": dict(use_hsdp=True, data_parallel_size=2),
    }[mode]
    config = DiffusionParallelConfig(**fields)
    rank = hsdp.distributed.get_rank()
    pipe = hp.load_pipeline(path, config, torch_dtype=torch.float32, progress=False)
    pipe.set_progress_bar_config(disable=True)
    for _, model in experts(pipe):
        model.enable_cache(cache_config(kind))  # after loading, as a user does
    prompts = PROMPTS if mode == "dp2" else PROMPTS[:1]
    gens = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
    out = hp.generate(pipe, prompt=prompts if len(prompts) > 1 else prompts[0], **CALL,
                      generator=gens if len(gens) > 1 else gens[0])
    watches = hp.pipeline_state(pipe).caches
    counts = {n: (w.counts.computed, w.counts.skipped) for n, w in watches.items()}
    disagreed = sum(w.counts.local_disagreed for w in watches.values())
    every = np.zeros((hsdp.distributed.get_world_size(), 5), dtype=np.int64)
    mine = np.array([*counts["transformer"], *counts["transformer_2"], disagreed], dtype=np.int64)
    hsdp.distributed.get_world_group().all_gather(mine, every)
    if rank == 0:
        groups = hp.pipeline_state(pipe).groups
        # every request's ranks counted its forwards; with lanes, the lanes' counts add up
        for i, prompt in enumerate(prompts):
            frames, want = stock(path, kind, prompt, i)
            diff = float(np.abs(out.frames[i : i + 1] - frames).max())
            assert diff <= 1e-4, (case, i, diff)
            if groups.dp_degree == 1:
                # with CFG parallel each branch's first rank counted its branch's forwards: add them
                firsts = [c * (every.shape[0] // groups.cfg_degree) for c in range(groups.cfg_degree)]
                total = every[firsts].sum(axis=0)
                got = {"transformer": tuple(int(x) for x in total[:2]), "transformer_2": tuple(int(x) for x in total[2:4])}
                assert got == want, (case, got, want)
            print(f"{case}: output {i} max abs {diff:.3g}, stock counts {want}", flush=True)
        if groups.dp_degree > 1:  # lane d ran output d: its leader's counts are that output's
            for d in range(groups.dp_degree):
                lead = d * (hsdp.distributed.get_world_size() // groups.dp_degree)
                want = stock(path, kind, prompts[d], d)[1]
                got = {"transformer": tuple(int(x) for x in every[lead, :2]),
                       "transformer_2": tuple(int(x) for x in every[lead, 2:4])}
                assert got == want, (case, d, got, want)
        if kind == "fbc" and "ulysses" in mode:  # the ranks' own shares would have decided apart
            assert every[:, 4].sum() > 0, (case, every.tolist())
        skipped = int(every[0, 1] + every[0, 3])
        assert skipped > 0 and int(every[0, 0] + every[0, 2]) > 0, (case, every.tolist())  # both kinds of step
        print(f"{case}: counts by rank {every.tolist()} (computed, skipped per expert; local disagreements)",
              flush=True)
    print(f"rank {rank}: {case} ok", flush=True)


def main() -> None:
    path = sys.argv[1]
    hsdp.distributed.init_process_group()
    for case in sys.argv[2:]:
        run(case, path)


if __name__ == "__main__":
    main()
