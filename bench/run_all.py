"""`make bench`: every benchmark in turn, each printing its own table of ratios.

The tables in docs/performance.md come from this run (with the command and the machine).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = [
    ("Figure 1: unit gather vs raw MPI_Allgather", ["bench_gather.py"]),
    ("Direct gathers: a gather beside busy ranks", ["bench_gather.py", "--busy"]),
    ("Figures 2 and 3: sharded vs unsharded forward, prefetch, residency", ["bench_forward.py"]),
    ("Figure 6: step time against the residency budget", ["bench_resident.py", "--size", "16", "--reps", "7"]),
    ("Figure 4: hook overhead", ["bench_hooks.py"]),
    ("Loading: streaming vs whole-model peak memory", ["bench_load.py"]),
    ("Torch: hsdp vs FSDP2 forward on a diffusers Wan model", ["bench_torch.py"]),
    ("Torch: loading peak, streaming vs FSDP2's full-then-shard", ["bench_torch.py", "--load"]),
    ("Torch: hook overhead", ["bench_torch.py", "--hooks"]),
    ("Ulysses: exchange vs raw all-to-all, memory and time by degree", ["bench_parallel.py"]),
    ("Pipelines: load_pipeline on 2 ranks vs the stock diffusers pipeline", ["bench_pipeline.py"]),
]


def main() -> int:
    failed = 0
    for title, cmd in BENCHES:
        if not (HERE / cmd[0]).exists():
            continue
        print(f"\n## {title}\n", flush=True)
        rc = subprocess.call([sys.executable, str(HERE / cmd[0]), *cmd[1:]], cwd=HERE.parent)
        failed += rc != 0
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
