"""hsdp.Omni, vllm-omni's offline API, from plain Python processes: the HSDP guide's quick start
and its combined-mode example (only the imports, the model id, the rank count and the sizes
changed: a tiny Wan 2.2 folder in a hand-built hub cache, offline, 2 ranks, 32x32x5), float32
frames of two prompts equal to the stock pipeline's, and nothing left behind (no process of the
job, no /dev/shm folder) after close(), after an exception in the caller, and after the caller
is killed."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from hsdp.omni.engine import OWNER_ENV
from hsdp.testing.hub_cache import place_in_cache
from hsdp.world.launch import JOB_DIR_PREFIX, job_base
from mpirun import MPI_ENV, ROOT

SIZES = "height=32, width=32, num_frames=5"


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> tuple[Path, Path]:
    """(hub cache, the tiny Wan 2.2 folder in it as tiny/wan22)."""
    from hsdp.testing.tiny_pipeline import make_tiny_pipeline

    root = tmp_path_factory.mktemp("omni")
    snap = place_in_cache(make_tiny_pipeline(root / "wan22", "wan22", seed=0), root / "hub", "tiny/wan22")
    return root / "hub", snap


@pytest.fixture
def hub_env(hub, monkeypatch) -> dict[str, str]:
    cache, _ = hub
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMI"))}
    env.update(MPI_ENV, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "python"), *filter(None, [env.get("PYTHONPATH")])]))
    for var in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", *MPI_ENV):
        monkeypatch.setenv(var, env[var])
    return env


def _left(owner: int, launcher: int | None) -> tuple[list[int], list[str]]:
    """Processes of an Omni's job (by the owner mark they carry) and its /dev/shm folders."""
    mark = f"{OWNER_ENV}={owner}".encode()
    procs = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        with open(f"/proc/{entry}/stat", "rb") as s:
                            if s.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X"):
                                procs.append(int(entry))
            except OSError:
                continue
    dirs = glob.glob(os.path.join(job_base(), f"{JOB_DIR_PREFIX}{launcher}.*")) if launcher else []
    return procs, dirs


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_the_guides_quick_start_and_combined_mode_under_plain_python(hub_env, tmp_path):
    quick = _script(tmp_path, "quick_start.py", f'''
        from hsdp import Omni
        from hsdp import OmniDiffusionSamplingParams
        from hsdp import DiffusionParallelConfig

        omni = Omni(
            model="tiny/wan22",
            parallel_config=DiffusionParallelConfig(
                use_hsdp=True,
                hsdp_shard_size=4,  # Shard across 4 GPUs (here 4 CPU ranks)
            ),
        )

        outputs = omni.generate(
            "A cat playing piano",
            OmniDiffusionSamplingParams(num_inference_steps=50, {SIZES}),
        )
        import sys
        frames = outputs[0].images[0]
        print("frames", outputs[0].final_output_type, frames.shape, frames.dtype, float(frames.std()) > 0,
              "torch imported:", "torch" in sys.modules)
    ''')
    combined = _script(tmp_path, "combined.py", f'''
        from hsdp import Omni
        from hsdp import OmniDiffusionSamplingParams
        from hsdp import DiffusionParallelConfig

        omni = Omni(
            model="tiny/wan22",
            parallel_config=DiffusionParallelConfig(
                ulysses_degree=2,  # Sequence parallel
                use_hsdp=True,     # HSDP overlays on SP
            ),
        )
        outputs = omni.generate("A cat playing piano", OmniDiffusionSamplingParams(num_inference_steps=4, {SIZES}))
        print("frames", outputs[0].images[0].shape, omni.info)
    ''')
    # both at once (two jobs of 2 ranks each; the suite's time): each its own plain python
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=hub_env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for script in (quick, combined)]
    (out_q, err_q), (out_c, err_c) = (proc.communicate(timeout=600) for proc in procs)
    assert procs[0].returncode == 0, out_q + err_q
    assert "frames video (5, 32, 32, 3) float32 True torch imported: False" in out_q, out_q
    assert procs[1].returncode == 0, out_c + err_c
    assert "frames (5, 32, 32, 3) {'pipeline': 'WanPipeline', 'world_size': 2}" in out_c, out_c


def test_float32_frames_equal_the_stock_pipeline_and_close_leaves_nothing(hub, hub_env):
    import torch
    from diffusers import DiffusionPipeline
    from hsdp import DiffusionParallelConfig, Omni, OmniDiffusionSamplingParams

    _, snap = hub
    prompts = ["a cat in the snow", {"prompt": "two dogs", "negative_prompt": "blurry"}]
    params = OmniDiffusionSamplingParams(num_inference_steps=3, height=32, width=32, num_frames=5, seed=7,
                                         max_sequence_length=16)
    with Omni(model="tiny/wan22", parallel_config=DiffusionParallelConfig(use_hsdp=True, hsdp_shard_size=2),
              dtype=torch.float32) as omni:
        launcher = omni.pid
        assert omni.info == {"pipeline": "WanPipeline", "world_size": 2} and omni.model == str(snap.resolve())
        procs, dirs = _left(os.getpid(), launcher)
        assert len(procs) >= 3 and dirs, (procs, dirs)  # the launcher, mpiexec, 2 ranks; the job's folder
        outputs = omni.generate(prompts, params)
        with pytest.raises(RuntimeError, match="WanPipeline takes no bogus"):  # the engine stays up after it
            omni.generate("x", OmniDiffusionSamplingParams(num_inference_steps=1, extra_args={"bogus": 1}))
        assert len(omni.generate("again", OmniDiffusionSamplingParams(num_inference_steps=1, height=32, width=32,
                                                                       num_frames=5))) == 1
    assert _left(os.getpid(), launcher) == ([], []), "left behind after close()"
    with pytest.raises(RuntimeError, match="after close"):
        omni.generate("x")
    stock = DiffusionPipeline.from_pretrained(snap, dtype=torch.float32)
    stock.set_progress_bar_config(disable=True)
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        call = {"prompt": prompt} if isinstance(prompt, str) else dict(prompt)
        want = stock(**call, num_inference_steps=3, height=32, width=32, num_frames=5, max_sequence_length=16,
                     output_type="np", generator=torch.Generator("cpu").manual_seed(7 + i)).frames[0]
        got = out.images[0]
        assert out.final_output_type == "video" and got.shape == (5, 32, 32, 3) and out.prompt == prompt
        assert np.abs(got - want).max() <= 1e-4, (i, np.abs(got - want).max())


CALLER = '''
import os, sys, time
from hsdp import DiffusionParallelConfig, Omni

omni = Omni(model="tiny/wan22", parallel_config=DiffusionParallelConfig(use_hsdp=True, hsdp_shard_size=2))
print("launcher", omni.pid, flush=True)
if sys.argv[1] == "raise":
    raise RuntimeError("the caller's own bug")
time.sleep(600)  # killed here
'''


def test_a_caller_that_raises_or_is_killed_leaves_nothing(hub_env, tmp_path):
    """Two callers at once (the suite's time): one raises after Omni started, one is killed."""
    script = _script(tmp_path, "caller.py", CALLER)
    raising = subprocess.Popen([sys.executable, str(script), "raise"], cwd=tmp_path, env=hub_env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = subprocess.Popen([sys.executable, str(script), "sleep"], cwd=tmp_path, env=hub_env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("launcher "), line
        launcher = int(line.split()[1])
        assert _left(proc.pid, launcher)[0], "the job should be running"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 60
    while _left(proc.pid, launcher) != ([], []) and time.monotonic() < deadline:
        time.sleep(0.2)  # polling for the job's end, not waiting for a result
    assert _left(proc.pid, launcher) == ([], []), "left behind after the caller was killed"

    stdout, stderr = raising.communicate(timeout=300)
    assert raising.returncode == 1 and "RuntimeError: the caller's own bug" in stderr, stderr
    launcher = int(stdout.split("launcher ")[1].split()[0])
    assert _left(raising.pid, launcher) == ([], []), "left behind after the caller's exception"
