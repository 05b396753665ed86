"""One rank of ``hsdp serve``'s engine on data-parallel lanes of 2 ranks (started on 4 ranks by
tests/test_serve_dp.py): the job store and the leader/follower loops, without HTTP.

`python tests/serve_lane_worker.py WAN22_DIR OUTPUT_DIR`: D=2 x Ulysses 2 (lane 0: ranks 0 and
1, lane 1: ranks 2 and 3). Four jobs, two rounds: in the first, each lane's job fails on the
lane's second rank alone (``HSDP_SERVE_FAULT_PROMPT`` set by the test), so the lane's first rank
only hears of it through the step vote; in the second, both jobs complete. Rank 0 prints each
job's status and error.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hsdp
import torch
from hsdp.cli.folder import read_folder
from hsdp.engine.config import DiffusionParallelConfig
from hsdp.pipelines import load_pipeline
from hsdp.pipelines.lanes import lane_groups
from hsdp.serve.jobs import Job, JobStore
from hsdp.serve.params import video_params
from hsdp.serve.worker import LeaderSettings, follower_loop, leader_loop

torch.set_num_threads(1)
PROMPTS = ["lane 0 fails on rank 1", "lane 1 fails on rank 3", "a cat in the snow", "a boat on a lake"]


def main() -> None:
    world = hsdp.distributed.init_process_group()
    assert world.size == 4, world.size
    folder = read_folder(Path(sys.argv[1]))
    config = DiffusionParallelConfig(use_hsdp=True, data_parallel_size=2, ulysses_degree=2)
    pipe = load_pipeline(folder.path, config, torch_dtype=torch.float32, progress=False)
    pipe.set_progress_bar_config(disable=True)
    groups = lane_groups(pipe)
    # the layout the faults are placed on: a lane's second rank is never its leader
    assert (groups.dp_rank, groups.lane_rank) == (world.rank // 2, world.rank % 2), (world.rank, groups)
    if world.rank != 0:
        follower_loop(world, pipe)
        return
    store = JobStore("wan22")
    fields = {"size": "32x32", "num_frames": "5", "num_inference_steps": "2", "seed": "3"}
    jobs = [store.submit(video_params({**fields, "prompt": p}, None, folder)) for p in PROMPTS]

    def finished(_job: Job) -> None:
        if all(j.done.is_set() for j in jobs):
            store.stop_accepting()  # the loop then ends and stops the other ranks

    store.on_finish.append(finished)
    ran = leader_loop(world, pipe, store, LeaderSettings(Path(sys.argv[2])))
    for job in jobs:
        print(f"job {job.params['prompt']!r}: {job.status}: {job.error}", flush=True)
    print(f"ran {ran}", flush=True)


if __name__ == "__main__":
    main()
