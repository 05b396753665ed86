"""The example scripts start their own ranks (hsdp.cli.ranks.launch_script), as hsdp generate
does: ``python examples/offline_inference/image_to_video/image_to_video.py --model DIR
--use-hsdp --hsdp-shard-size 2`` with no launcher (and no --prompt or --image: the example's
defaults), tiny sizes, float32, --verify against the stock pipeline."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from hsdp.testing.tiny_pipeline import make_tiny_pipeline
from mpirun import MPI_ENV, ROOT


def test_image_to_video_example_starts_its_ranks(tmp_path):
    folder = make_tiny_pipeline(tmp_path / "i2v", "wan22-i2v")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMI"))}
    env.update(MPI_ENV, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), *filter(None, [env.get("PYTHONPATH")])]))
    out = tmp_path / "frames.npy"
    proc = subprocess.run([sys.executable, "examples/offline_inference/image_to_video/image_to_video.py",
                           "--model", str(folder), "--use-hsdp", "--hsdp-shard-size", "2",
                           "--height", "32", "--width", "32", "--num-frames", "5", "--num-inference-steps", "2",
                           "--dtype", "float32", "--verify", "--output", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "image_to_video.py: starting 2 ranks (HSDP standalone: replicate=1 x shard=2 (world 2)) with " \
           "hsdp.launch" in proc.stderr, proc.stderr
    assert proc.stdout.count("holds") == 2 and "verify: max |diff| vs the stock pipeline" in proc.stdout
    assert ": ok" in proc.stdout, proc.stdout
    frames = np.load(out)
    assert frames.shape == (5, 32, 32, 3) and frames.std() > 0
