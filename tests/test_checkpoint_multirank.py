"""Streaming checkpoint loads across real MPI ranks: one mpiexec launch per world size runs, on
each of its meshes in turn, every
check of tests/ckpt_worker.py (streaming == whole-then-shard bit for bit on a file written
by the reference safetensors package, a multi-file checkpoint, int8 and ignored parameters;
bf16 and f16 sources widened to float32, against the source's bytes; bytes read; a failure
on one rank; a missing key)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import safetensors.numpy as stnp

from hsdp import models
from hsdp.checkpoint import save_checkpoint
from mpirun import run_ranks

MESHES = {2: [(1, 2)], 4: [(2, 2), (1, 4)]}  # by world size: a launch per mesh would cost its start


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    tiny = models.make_model("tiny", seed=0)
    stnp.save_file({n: p.data for n, p in tiny.named_parameters()}, str(root / "ref_tiny.safetensors"))
    (root / "small").mkdir()
    files = save_checkpoint(models.make_model("small", seed=1), root / "small" / "model.safetensors.index.json",
                            max_shard_bytes=1_000_000)
    assert len(files) > 3
    save_checkpoint(models.make_model("tiny", variant="quantized", seed=2), root / "quant_tiny.safetensors")
    save_checkpoint(models.make_model("tiny", variant="ignored", seed=3), root / "ignored_tiny.safetensors")
    src = models.make_model("tiny", seed=4)
    for dtype, name in (("bfloat16", "bf16_tiny"), ("float16", "f16_tiny")):  # widened to float32 on load
        save_checkpoint({n: (p.data, dtype) for n, p in src.named_parameters()}, root / f"{name}.safetensors")
    return root


@pytest.mark.parametrize("n", list(MESHES), ids=["+".join(f"{r}x{s}" for r, s in m) for m in MESHES.values()])
def test_streaming_load(checkpoints: Path, n: int) -> None:
    proc = run_ranks(n, "tests/ckpt_worker.py", ",".join(str(r) for r, _ in MESHES[n]), str(checkpoints),
                     timeout=240)
    for r, s in MESHES[n]:
        assert r * s == n
        # Ranks share stdout, so their lines may run together: count ranks, not lines.
        done = set(re.findall(rf"rank (\d+)/{n} mesh \({r}x{s}\): [\w ,-]+ OK", proc.stdout))
        assert done == {str(k) for k in range(n)}, (r, s, proc.stdout)
