"""A hostile-but-legal header: the tiny model's tensors plus N zero-size tensors (default
1,000,000), loaded with `load_model_sharded` on 2 ranks (a key_map drops the extra names).

Prints, per rank, the peak resident set (VmHWM, /proc/self/status) before the load (after
imports and MPI start-up) and after it, and the seconds the load took. The goal of issue 12:
peak <= 200 MB per rank (MiB = 2^20 bytes in the table).

    PYTHONPATH=python .venv/bin/python bench/bench_header.py [--tensors 1000000] [--ranks 2]
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def make(path: Path, extra: int) -> int:
    """Writes the file (in this process, before any rank starts); returns the header bytes."""
    from hsdp import models
    from hsdp.checkpoint import save_checkpoint

    base = path.with_suffix(".base")
    save_checkpoint(models.make_model("tiny", seed=0), base)
    raw = base.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + hlen])
    data = raw[8 + hlen :]
    end = len(data)
    parts = [json.dumps(header)[:-1]]  # the model's entries, then the extra ones, streamed out
    zero = f'{{"dtype":"F32","shape":[0],"data_offsets":[{end},{end}]}}'
    parts.extend(f',"extra.{i:07d}.weight":{zero}' for i in range(extra))
    parts.append("}")
    text = "".join(parts).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    base.unlink()
    return len(text)


def worker(path: str, out: str) -> None:
    from harness import vm_kib

    import hsdp
    from hsdp import models, nn
    from hsdp.checkpoint import load_model_sharded

    world = hsdp.distributed.init_process_group()
    base = vm_kib()
    with nn.meta_init():
        model = models.make_model("tiny")
    world.barrier()
    t0 = time.perf_counter()
    load_model_sharded(model, path, hsdp.HSDPInferenceConfig(enabled=True), progress=False,
                       key_map=lambda n: None if n.startswith("extra.") else n)
    seconds = time.perf_counter() - t0
    rec = {"rank": world.rank, "baseline_kib": base, "peak_kib": vm_kib(), "seconds": seconds}
    Path(out, f"rank{world.rank}.json").write_text(json.dumps(rec))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=1_000_000)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--worker", nargs=2, metavar=("FILE", "OUT"))
    a = ap.parse_args()
    if a.worker:
        worker(*a.worker)
        return
    from harness import launch

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "hostile.safetensors")
        hbytes = make(path, a.tensors)
        print(f"header: {a.tensors} zero-size tensors + the tiny model's, {hbytes / 1e6:.1f} MB; {a.ranks} ranks")
        launch(a.ranks, __file__, "--worker", str(path), tmp)
        print("| rank | baseline VmHWM MiB | peak VmHWM MiB | load s |")
        print("|---|---|---|---|")
        for r in range(a.ranks):
            rec = json.loads(Path(tmp, f"rank{r}.json").read_text())
            print(f"| {r} | {rec['baseline_kib'] / 1024:.1f} | {rec['peak_kib'] / 1024:.1f} | {rec['seconds']:.2f} |")


if __name__ == "__main__":
    main()
