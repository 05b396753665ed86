"""``hsdp generate`` (python -m hsdp generate): bad input refused with exit 2 before any heavy
work (in process, and on every rank of a job), then the real thing on tiny pipeline folders:
a self-launched 2-rank bfloat16 run writing an mp4 checked against the stock unsharded
pipeline with --verify, an image-to-video CFG-parallel run inside mpiexec writing .npy, and a Flux .png
in process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpirun import MPI_ENV, ROOT, mpiexec

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("imageio_ffmpeg")

from hsdp.cli import generate as cli  # noqa: E402
from hsdp.testing.tiny_pipeline import make_tiny_pipeline  # noqa: E402

SIZE = ["--height", "32", "--width", "32"]
VIDEO = [*SIZE, "--num-frames", "5", "--num-inference-steps", "2"]
# Variables that mark a process as one rank of a launched job: a self-launch test runs without them.
RANK_VARS = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK", "PMIX_RANK",
             "MPI_LOCALNRANKS", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipelines")
    return {kind: make_tiny_pipeline(root / kind, kind) for kind in ("wan22", "wan22-i2v", "flux")}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), *filter(None, [env.get("PYTHONPATH")])])
    return {**env, **MPI_ENV}


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc


def _report(output: Path) -> dict:
    return json.loads(output.with_suffix(".json").read_text())


def _check_sharded(report: dict, world: int, verified: bool = True) -> None:
    assert report["world_size"] == world
    if verified:
        assert report["verify"]["ok"] and report["verify"]["max_abs_diff"] <= 1e-4, report["verify"]
    else:
        assert report["verify"] is None
    held = report["held_bytes_per_component_per_rank"]
    for name in ("transformer", "transformer_2", "text_encoder"):
        assert len(held[name]) == world and max(held[name]) > 0
    assert report["timing"]["steps"] == 2 and len(report["peak_rss_bytes_per_rank"]) == world


# ------------------------------------------------------------------------- bad input


def test_bad_input_exits_2_naming_what_is_wrong(folders, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the default --output (outputs/...) would go
    wan, i2v, flux = (str(folders[k]) for k in ("wan22", "wan22-i2v", "flux"))
    not_image = tmp_path / "notes.png"
    not_image.write_text("not an image")
    cases = [
        (["--model", str(tmp_path / "none"), "--prompt", "a cat"], "no such folder"),
        (["--model", str(tmp_path), "--prompt", "a cat"], "not a diffusers pipeline folder (no model_index.json)"),
        (["--model", wan, "--prompt", "a cat", "--height", "40"], "--height 40 is not a multiple of 16"),
        (["--model", flux, "--prompt", "a cat", "--width", "30"], "--width 30 is not a multiple of 4"),
        (["--model", wan, "--prompt", "a cat", "--num-frames", "6"], "num_frames - 1 to be a multiple of 4"),
        (["--model", wan, "--prompt", "a cat", "--output", "x.png"], ".png is not an output of WanPipeline"),
        (["--model", wan, "--prompt", "a cat", "--output", "x.webm"], "unsupported suffix '.webm'"),
        (["--model", wan, "--prompt", "a cat", "--output", str(not_image / "x.mp4")], "is not a folder"),
        (["--model", flux, "--prompt", "a cat", "--output", "x.mp4"], ".mp4 is not an output of FluxPipeline"),
        (["--model", flux, "--prompt", "a cat", "--num-frames", "5"], "--num-frames is for video pipelines"),
        (["--model", wan, "--prompt", "a cat", "--image", str(not_image)], "--image is for image-to-video folders"),
        (["--model", i2v, "--prompt", "a cat"], "is image-to-video: give the first frame with --image"),
        (["--model", i2v, "--prompt", "a cat", "--image", str(not_image)], "not an image PIL can read"),
        (["--model", i2v, "--prompt", "a cat", "--image", str(tmp_path / "no.png")], "no such file"),
        (["--model", wan, "--prompt", " "], "--prompt is empty"),
        (["--model", wan, "--prompt", "a cat", "--prompt", ""], "prompt 1 is empty (counted from 0"),
        (["--model", wan], "give a prompt: --prompt TEXT (repeatable) or --prompt-file FILE"),
        (["--model", wan, "--prompt-file", str(tmp_path / "no.txt")], "--prompt-file"),
        (["--model", wan, "--prompt", "a cat", "--num-inference-steps", "0"], "--num-inference-steps must be >= 1"),
        (["--model", wan, "--prompt", "a cat", "--use-hsdp"], "standalone HSDP mode needs an explicit hsdp_shard_size"),
        (["--model", wan, "--prompt", "a cat", "--ring-degree", "0"], "ring_degree must be a positive int, got 0"),
        (["--model", wan, "--prompt", "a cat", "--cfg-parallel-size", "2", "--guidance-scale", "1"],
         "--guidance-scale 1 turns guidance off"),
        (["--model", flux, "--prompt", "a cat", "--cfg-parallel-size", "2"],
         "FluxPipeline guides only with --true-cfg-scale above 1 and a --negative-prompt"),
        (["--model", wan, "--prompt", "a cat", "--true-cfg-scale", "4"], "--true-cfg-scale is for Flux pipelines"),
        (["--model", wan, "--prompt", "a cat", "--dtype", "int8"], "invalid choice: 'int8'"),
        (["--model", wan, "--prompt", "a cat", "--verify-tolerance", "-1"], "--verify-tolerance must be >= 0"),
        # sequence parallel, from the folder's config files: heads for Ulysses, tokens for both
        (["--model", wan, "--prompt", "a cat", "--ulysses-degree", "4"],
         "transformer/config.json has num_attention_heads=2, not divisible by it"),
        (["--model", flux, "--prompt", "a cat", "--ring-degree", "4", "--height", "4", "--width", "4"],
         "splits the 1 image tokens of --height 4 --width 4 over 4 ranks, more ranks than tokens"),
        (["--model", wan, "--prompt", "a cat", "--use-hsdp", "--hsdp-shard-size", "2", "--vae-patch-parallel-size",
          "3"], "vae_patch_parallel_size=3 spreads the VAE's tiles over ranks that run the same request"),
    ]
    # Found by load_pipeline, still before any weight is read: a sharded model without safetensors
    no_weights = tmp_path / "no-weights"
    shutil.copytree(folders["wan22"], no_weights)
    for f in (no_weights / "transformer_2").glob("*.safetensors*"):
        f.unlink()
    cases.append((["--model", str(no_weights), "--prompt", "a cat", "--use-hsdp", "--hsdp-shard-size", "1"],
                  "holds no safetensors weights"))
    for argv, message in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err, (argv, err)
    assert not (tmp_path / "outputs").exists()


def test_the_hsdp_command_and_its_packaging(capsys):
    from hsdp.__main__ import main

    assert main([]) == 2 and "commands:" in capsys.readouterr().err
    assert main(["--help"]) == 0 and "generate" in capsys.readouterr().out
    assert main(["serve-nothing"]) == 2 and "unknown command 'serve-nothing'" in capsys.readouterr().err
    assert main(["generate", "--help"]) == 0 and "--hsdp-shard-size" in capsys.readouterr().out
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["hsdp"] == "hsdp.__main__:main"
    for extra in ("diffusers", "test"):  # what a pipeline folder and a video file need
        names = {req.split(">")[0].split("=")[0] for req in project["optional-dependencies"][extra]}
        assert {"transformers", "tokenizers", "ftfy", "imageio", "imageio-ffmpeg", "diffusers"} <= names, extra


def test_bad_input_and_wrong_job_size_fail_on_every_rank(folders, tmp_path):
    # Inside mpiexec: each rank refuses, says so with its rank, and the job exits 2.
    base = [mpiexec(), "-n", "2", sys.executable, "-m", "hsdp", "generate"]
    proc = _run([*base, "--model", str(tmp_path / "none"), "--prompt", "a cat"], tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] hsdp generate: error: --model {tmp_path / 'none'}: no such folder" in proc.stderr
    proc = _run([*base, "--model", str(folders["wan22"]), "--prompt", "a cat", "--use-hsdp", "--hsdp-shard-size", "4"],
                tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "needs 4 ranks (HSDP standalone: replicate=1 x shard=4 (world 4)) but the job was launched with 2" \
        in proc.stderr


# ------------------------------------------------------------------------- runs


def test_self_launched_ranks_write_an_mp4_that_matches_the_stock_pipeline(folders, tmp_path):
    # No launcher variables: the command starts its 2 ranks itself through hsdp.launch.
    out = tmp_path / "outputs" / "cat.mp4"
    proc = _ok(_run([sys.executable, "-m", "hsdp", "generate", "--model", str(folders["wan22"]),
                     "--prompt", "a cat running in the snow", *VIDEO, "--seed", "3",  # bfloat16, the default
                     "--use-hsdp", "--hsdp-shard-size", "2", "--verify", "--output", str(out)], tmp_path))
    assert "starting 2 ranks (HSDP standalone: replicate=1 x shard=2 (world 2)) with hsdp.launch" in proc.stderr
    # in bfloat16 the reference stores and casts its sharded components as hsdp does
    assert "(ok, tolerance 0.0001)" in proc.stdout and "as hsdp stores and casts them" in proc.stdout
    import imageio

    with imageio.get_reader(out) as reader:
        frames = [f for f in reader]
        assert reader.get_meta_data()["fps"] == 16
    assert len(frames) == 5 and frames[0].shape == (32, 32, 3)
    report = _report(out)
    _check_sharded(report, 2)
    assert report["dtype"] == "bfloat16" and report["verify"]["reference"] != "stock"
    assert report["frames_shape"] == [5, 32, 32, 3] and report["call"]["prompt"] == "a cat running in the snow"


def test_several_prompts_over_data_parallel_lanes(folders, tmp_path):
    """--prompt twice and a --prompt-file over 2 lanes (--dp 2): NAME-0.npy, NAME-1.npy, NAME-2.npy in
    prompt order, each seeded --seed + i and equal to the stock pipeline called with it alone; the
    report gives outputs per minute."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red boat on a lake\n\n")
    out = tmp_path / "o" / "many.npy"
    proc = _ok(_run([sys.executable, "-m", "hsdp", "generate", "--model", str(folders["wan22"]), "--prompt",
                     "a cat in the snow", "--prompt", "two dogs", "--prompt-file", str(prompts), *VIDEO,
                     "--dtype", "float32", "--seed", "5", "--use-hsdp", "--dp", "2", "--verify", "--output", str(out)],
                    tmp_path))
    assert "2 lanes of 1 rank" in proc.stdout and "outputs per minute" in proc.stdout, proc.stdout
    report = _report(out)
    _check_sharded(report, 2)
    assert report["outputs"] == [str(out.with_name(f"many-{i}.npy")) for i in range(3)]
    assert report["call"]["prompt"] == ["a cat in the snow", "two dogs", "a red boat on a lake"]
    assert report["timing"]["outputs_per_minute"] > 0
    import numpy as np

    frames = [np.load(out.with_name(f"many-{i}.npy")) for i in range(3)]
    assert all(f.shape == (5, 32, 32, 3) for f in frames) and not np.array_equal(frames[0], frames[1])


def test_inside_mpiexec_image_to_video_with_cfg_parallel_writes_npy(folders, tmp_path):
    # Already a rank of a 2-rank job: no second launch; image to video, CFG parallel with HSDP
    # over the same ranks.
    from PIL import Image

    first = tmp_path / "first.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(first)
    out = tmp_path / "frames.npy"
    proc = _ok(_run([mpiexec(), "-n", "2", sys.executable, "-m", "hsdp", "generate",
                     "--model", str(folders["wan22-i2v"]), "--image", str(first), "--prompt", "a dog on the grass",
                     "--negative-prompt", "blurry", *VIDEO, "--dtype", "float32", "--cfg-parallel-size", "2",
                     "--use-hsdp", "--output", str(out)], tmp_path))
    assert "starting" not in proc.stderr
    frames = np.load(out)
    assert frames.shape == (5, 32, 32, 3) and frames.dtype == np.float32
    assert 0.0 <= frames.min() and frames.max() <= 1.0 and frames.std() > 0
    report = _report(out)
    _check_sharded(report, 2, verified=False)
    assert report["pipeline"] == "WanImageToVideoPipeline" and report["parallel_config"]["cfg_parallel_size"] == 2


def test_flux_writes_a_png_in_process(folders, tmp_path, capsys):
    # A world of one needs no launcher: the command runs in this process.
    out = tmp_path / "image.png"
    assert cli.main(["--model", str(folders["flux"]), "--prompt", "a red car", *SIZE, "--num-inference-steps", "2",
                     "--dtype", "float32", "--verify", "--output", str(out)]) == 0, capsys.readouterr().err
    assert "(ok, tolerance 0.0001)" in capsys.readouterr().out
    from PIL import Image

    with Image.open(out) as img:
        assert img.size == (32, 32) and img.mode == "RGB"
    report = _report(out)
    assert report["frames_shape"] == [32, 32, 3] and report["world_size"] == 1 and report["verify"]["ok"]


def test_verify_with_a_float8_wire_checks_the_wires_bound(folders, tmp_path, capsys):
    """--verify with --hsdp-wire-dtype float8_e4m3fn: the frames cannot agree to 1e-4 (the wire is
    lossy), so the check is the wire's documented bound on a model's output (relative L2 0.05),
    and the verify line says so (issue 37: it used to report MISMATCH at the exact tolerance)."""
    out = tmp_path / "image.png"
    code = cli.main(["--model", str(folders["flux"]), "--prompt", "a red car", *SIZE, "--num-inference-steps", "2",
                     "--dtype", "float32", "--use-hsdp", "--hsdp-shard-size", "1", "--hsdp-wire-dtype", "float8_e4m3fn", "--verify",
                     "--output", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.out + printed.err
    assert "(ok, bound 0.05: the float8 wire's documented bound on a model's output" in printed.out, printed.out
    verify = _report(out)["verify"]
    assert verify["wire_rel_l2_bound"] == 0.05 and 0 < verify["rel_l2"] <= 0.05, verify
    assert verify["max_abs_diff"] > verify["tolerance"], verify  # the exact check would have failed
