"""Peak memory and time of loading a checkpoint: streaming rank-local vs load-whole-then-shard.

    .venv/bin/python bench/bench_load.py [--preset large] [--shards 1 2 4] [--repeat 5]

Writes a float32 safetensors checkpoint of the preset (the largest by default), then for
each shard size S runs S ranks under mpiexec with each strategy:

- streaming: ``hsdp.load_model_sharded`` into a model built under ``meta_init``;
- whole: ``load_model_whole`` (every rank reads the full model) then ``apply_hsdp_to_model``.

Each rank reports its VmHWM (peak resident set, from /proc/self/status) after the load, and
its baseline: VmHWM after the imports and MPI start-up, before the model exists. The goal
for streaming: peak <= 1.10 * (shard bytes + one block + baseline), where the shard bytes
are what the core holds (``hsdp.memory_stats``: shards plus parameters kept whole) and one
block is the largest unit's bytes as stored in the checkpoint. Two extra rows at (2x2)
compare replica 0 reading and broadcasting with every replica reading.

Prints a markdown table (MiB = 2^20 bytes). Load time: the median over repeats (run
interleaved, row after row, so a busy machine slows every row alike) of the slowest rank.
Memory columns: the rank and repeat with the highest peak / target. "read, all ranks":
file bytes read by the whole job. The page cache is warm (the file was just written), so
times are memory-bound, not disk-bound.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import vm_kib  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

MIB = 1 << 20


# ----------------------------------------------------------------------------- helpers


def emit(out_dir: str, rank: int, record: dict[str, Any]) -> None:
    """One JSON file per rank (ranks share stdout, where their lines can run together)."""
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"rank": rank, **record}))


def run_ranks(n: int, *args: str, timeout: float = 600) -> list[dict[str, Any]]:
    """Runs `python ARGS... OUT_DIR` on n ranks; returns each rank's emitted record, by rank."""
    # The tests' mpiexec environment, imported here only: the ranks must not pay for pytest.
    sys.path.insert(0, str(ROOT / "tests"))
    from mpirun import MPI_ENV

    exe = shutil.which("mpiexec")
    if exe is None:
        raise SystemExit("mpiexec is not installed (apt-get install openmpi-bin)")
    with tempfile.TemporaryDirectory(prefix="hsdp-bench-") as out:
        cmd = [exe, "-n", str(n), sys.executable, *args, out]
        env = {**os.environ, **MPI_ENV}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        files = sorted(Path(out).glob("rank*.json"))
        if len(files) != n:
            raise SystemExit(f"expected {n} rank records, got {len(files)}:\n{proc.stdout}\n{proc.stderr}")
        return sorted((json.loads(f.read_text()) for f in files), key=lambda r: r["rank"])


# ----------------------------------------------------------------------------- one rank


def worker(strategy: str, ckpt: str, preset: str, replicate: int, every_replica: bool, out: str) -> None:
    import hsdp
    import hsdp.checkpoint as hc
    from hsdp import models, nn
    from hsdp.world.distributed import init_process_group

    world = init_process_group()
    world.barrier()
    baseline = vm_kib()  # imports + MPI, no model yet
    with nn.meta_init():
        model = models.make_model(preset)
    config = hsdp.HSDPInferenceConfig(enabled=True, hsdp_replicate_size=replicate)
    world.barrier()
    t0 = time.perf_counter()
    if strategy == "streaming":
        hc.load_model_sharded(model, ckpt, config, progress=False, read_on_every_replica=every_replica)
    else:
        hc.load_model_whole(model, ckpt, progress=False)
        hsdp.apply_hsdp_to_model(model, config)
    world.barrier()
    seconds = time.perf_counter() - t0
    peak = vm_kib()
    stats = hsdp.memory_stats()
    with hc.open_checkpoint(ckpt) as ck:
        block = max(sum(ck[n].nbytes for n in u.names) for u in hsdp.get_units(model))
        model_bytes = ck.nbytes
    report = hc.load_report(model)
    emit(out, world.rank, {
        "baseline": baseline * 1024, "peak": peak * 1024, "seconds": seconds,
        "held": stats["sharded_bytes"] + stats["whole_bytes"], "block": block, "model": model_bytes,
        "bytes_read": report.bytes_read,
    })


# ----------------------------------------------------------------------------- the driver


def largest_preset() -> str:
    from hsdp import models, nn

    with nn.meta_init():
        sizes = {name: models.param_nbytes(models.make_model(name)) for name in models.preset_names()}
    return max(sizes, key=sizes.__getitem__)


def write_checkpoint(preset: str, path: Path) -> int:
    from hsdp import models
    from hsdp.checkpoint import save_checkpoint

    model = models.make_model(preset, seed=0)
    save_checkpoint(model, path)
    del model
    gc.collect()
    return path.stat().st_size


Config = tuple[int, int, str, bool]  # shard, replicate, strategy, every replica reads


def run_config(ckpt: Path, preset: str, config: Config) -> list[dict[str, Any]]:
    shard, replicate, strategy, every = config
    args = ["bench/bench_load.py", "--worker", strategy, str(ckpt), preset, str(replicate), str(int(every))]
    return run_ranks(replicate * shard, *args)


def summarize(config: Config, runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    shard, replicate, strategy, every = config
    flat = [r for run in runs for r in run]
    for r in flat:
        r["target"] = r["held"] + r["block"] + r["baseline"]
    worst = max(flat, key=lambda r: r["peak"] / r["target"])  # the rank furthest from its goal
    return {
        "mesh": f"{replicate}x{shard}", "strategy": strategy + (" (every replica reads)" if every else ""),
        "seconds": statistics.median(max(r["seconds"] for r in run) for run in runs),
        **{k: worst[k] for k in ("peak", "baseline", "held", "block", "model", "target")},
        "over": worst["peak"] - worst["baseline"],
        "read": sum(r["bytes_read"] for r in runs[0]),
    }


def row(m: dict[str, Any]) -> str:
    target = m["target"]
    ratio = m["peak"] / target
    if m["strategy"].startswith("streaming"):
        goal = f"{ratio:.3f}: {'met' if ratio <= 1.10 else 'not met'}"
    else:
        goal = f"{ratio:.3f} (holds the full model: peak - baseline = {m['over'] / m['model']:.2f} x model)"
    return (
        f"| {m['mesh']} | {m['strategy']} | {m['seconds']:.2f} | {m['peak'] / MIB:.1f} | {m['baseline'] / MIB:.1f} | "
        f"{m['over'] / MIB:.1f} | {m['held'] / MIB:.1f} | {m['block'] / MIB:.1f} | {target / MIB:.1f} | "
        f"{m['read'] / MIB:.1f} | {goal} |"
    )


HEADER = (
    "| mesh (RxS) | strategy | load s | peak VmHWM MiB | baseline MiB | peak - baseline MiB | shards MiB | "
    "one block MiB | target MiB | read, all ranks MiB | peak / target |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--worker":
        strategy, ckpt, preset, replicate, every, out = argv[1:7]
        worker(strategy, ckpt, preset, int(replicate), every == "1", out)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default=None, help="model preset (default: the largest)")
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-replicas", action="store_true", help="skip the (2x2) replica rows")
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    args = ap.parse_args(argv)
    preset = args.preset or largest_preset()
    with tempfile.TemporaryDirectory(prefix="hsdp-bench-load-", dir=args.dir) as d:
        ckpt = Path(d) / f"{preset}.safetensors"
        size = write_checkpoint(preset, ckpt)
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
        print(f"checkpoint: preset {preset!r}, float32, {size / MIB:.1f} MiB; shards stored bfloat16 (the default "
              f"param_dtype); {os.cpu_count()} cores, {mem:.0f} GiB; {args.repeat} repeats\n", flush=True)
        configs: list[Config] = [(s, 1, strat, False) for s in args.shards for strat in ("streaming", "whole")]
        if not args.no_replicas:
            configs += [(2, 2, "streaming", False), (2, 2, "streaming", True)]
        runs: dict[Config, list[list[dict[str, Any]]]] = {c: [] for c in configs}
        for _ in range(args.repeat):  # interleaved: drift on a shared machine hits every row alike
            for c in configs:
                runs[c].append(run_config(ckpt, preset, c))
        rows = [summarize(c, runs[c]) for c in configs]
    print(HEADER)
    for m in rows:
        print(row(m))


if __name__ == "__main__":
    main(sys.argv[1:])
