"""Hugging Face hub ids (hsdp.hub) from a cache laid out by hand, with no network
(HF_HUB_OFFLINE=1): resolved by revision, HF_HUB_CACHE and HF_HOME honoured, the offline
refusal naming the download command; the same snapshot on every rank of a job; ``--model
ORG/NAME`` through a self-launched ``hsdp generate``; ``load_pipeline`` with a hub id and its
``dtype=`` keyword."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hsdp.hub import HubError, cache_dir, is_hub_id, pin_model_argv, resolve_model
from hsdp.testing.hub_cache import place_in_cache
from mpirun import MPI_ENV, ROOT, run_ranks

COMMIT = "1234567890abcdef1234567890abcdef12345678"
OTHER = "fedcba0987654321fedcba0987654321fedcba09"


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache in HF_HUB_CACHE, the network off."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def _folder(path: Path, text: str = "{}") -> Path:
    path.mkdir(parents=True)
    (path / "model_index.json").write_text(text)
    return path


def test_an_id_resolves_to_its_cached_snapshot_by_revision(tmp_path, offline_cache):
    main = place_in_cache(_folder(tmp_path / "a", '{"v": 1}'), offline_cache, "org/model", COMMIT)
    dev = place_in_cache(_folder(tmp_path / "b", '{"v": 2}'), offline_cache, "org/model", OTHER, branches=("dev",))
    assert resolve_model("org/model") == main and main.name == COMMIT
    assert resolve_model("org/model", "dev") == dev
    assert resolve_model("org/model", OTHER) == dev  # a commit
    assert (resolve_model("org/model") / "model_index.json").read_text() == '{"v": 1}'


def test_hf_home_is_honoured(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cache_dir() == tmp_path / "home" / "hub"
    snap = place_in_cache(_folder(tmp_path / "f"), tmp_path / "home" / "hub", "org/m", COMMIT)
    assert resolve_model("org/m") == snap


def test_offline_and_missing_names_the_download_command(offline_cache):
    with pytest.raises(HubError, match=r"'org/absent' is not in the Hugging Face cache .*HF_HUB_OFFLINE is set.*"
                       r"`hf download org/absent`"):
        resolve_model("org/absent")
    with pytest.raises(HubError, match=r"at revision 'v2'.*`hf download org/absent --revision v2`"):
        resolve_model("org/absent", "v2")
    with pytest.raises(HubError, match="downloads are off here"):  # the caller forbids it, network or not
        resolve_model("org/absent", download=False)


def test_folders_stay_folders(tmp_path, offline_cache, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _folder(tmp_path / "org" / "model")  # a relative folder that looks like an id is a folder
    assert not is_hub_id("org/model") and resolve_model("org/model") == Path("org/model")
    assert resolve_model("/no/such/folder") == Path("/no/such/folder")  # not an id: the folder check reports it
    assert not is_hub_id("a/b/c") and not is_hub_id("./x") and is_hub_id("Wan-AI/Wan2.2-T2V-A14B-Diffusers")
    with pytest.raises(HubError, match=r"'org/model' is a folder, not a hub id .*revision='dev'"):
        resolve_model("org/model", "dev")


def test_pin_model_argv():
    argv = ["--model", "org/m", "--revision", "dev", "--prompt", "x", "--revision=v", "--use-hsdp"]
    assert pin_model_argv(argv, "/snap") == ["--model", "/snap", "--prompt", "x", "--use-hsdp"]
    assert pin_model_argv(["--model=org/m"], "/s", "org/m") == ["--model=/s", "--served-model-name", "org/m"]
    assert pin_model_argv(["--model", "d", "--served-model-name", "n"], "d", "x") == [
        "--model", "d", "--served-model-name", "n"]


def test_every_rank_resolves_rank_0s_snapshot(tmp_path, offline_cache):
    snap = place_in_cache(_folder(tmp_path / "f"), offline_cache, "org/model", COMMIT)
    env = {"HF_HUB_CACHE": str(offline_cache), "HF_HUB_OFFLINE": "1"}
    out = run_ranks(2, "tests/hub_worker.py", "org/model", "ok", env=env, timeout=120).stdout
    assert out.count(f"resolved {snap}") == 2, out
    out = run_ranks(2, "tests/hub_worker.py", "org/absent", "missing", env=env, timeout=120).stdout
    assert out.count("HubError: model 'org/absent' is not in the Hugging Face cache") == 2, out


# ------------------------------------------------------------- with a real pipeline folder

torch_needed = pytest.mark.skipif(
    any(__import__("importlib").util.find_spec(m) is None for m in ("torch", "diffusers", "transformers")),
    reason="needs torch, diffusers and transformers")


@pytest.fixture(scope="module")
def hub_wan(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Wan 2.2 folder placed in a hand-built hub cache as tiny/wan22: (cache, snapshot)."""
    from hsdp.testing.tiny_pipeline import make_tiny_pipeline

    root = tmp_path_factory.mktemp("hub")
    folder = make_tiny_pipeline(root / "wan22", "wan22")
    return root / "cache", place_in_cache(folder, root / "cache", "tiny/wan22", COMMIT)


@torch_needed
def test_load_pipeline_takes_an_id_and_dtype(hub_wan, monkeypatch):
    import hsdp.pipelines as hp
    import torch

    cache, snap = hub_wan
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"torch_dtype=torch.float32 and dtype=torch.bfloat16: they name the same"):
        hp.load_pipeline("tiny/wan22", torch_dtype=torch.float32, dtype=torch.bfloat16)
    pipe = hp.load_pipeline("tiny/wan22", dtype=torch.float32, progress=False)  # diffusers' current keyword
    assert pipe.transformer.dtype == torch.float32 and Path(pipe.config._name_or_path) == snap
    pipe = hp.load_pipeline("tiny/wan22", torch_dtype=torch.float32, dtype=torch.float32, progress=False)
    assert pipe.vae.dtype == torch.float32


@torch_needed
def test_generate_model_id_self_launched(hub_wan, tmp_path):
    """``hsdp generate --model tiny/wan22`` from a plain shell on 2 ranks: resolved once here,
    the ranks handed the snapshot; offline."""
    cache, snap = hub_wan
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMI"))}
    env.update(MPI_ENV, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "python"), *filter(None, [env.get("PYTHONPATH")])]))
    out = tmp_path / "cat.npy"
    proc = subprocess.run([sys.executable, "-m", "hsdp", "generate", "--model", "tiny/wan22", "--prompt", "a cat",
                           "--height", "32", "--width", "32", "--num-frames", "5", "--num-inference-steps", "2",
                           "--dtype", "float32", "--use-hsdp", "--hsdp-shard-size", "2", "--output", str(out)],
                          check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "starting 2 ranks" in proc.stderr and out.is_file()
    import json

    assert Path(json.loads(out.with_suffix(".json").read_text())["model"]) == snap
    bad = subprocess.run([sys.executable, "-m", "hsdp", "generate", "--model", "tiny/absent", "--prompt", "x"],
                         check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "`hf download tiny/absent`" in bad.stderr, bad.stderr


def test_serve_model_id_resolves_to_its_snapshot_and_is_served_by_its_id(hub_wan, monkeypatch):
    """``hsdp serve tiny/wan22``: the checks the command runs before any rank starts resolve
    the id to its cached snapshot (offline), and the model is listed under the id."""
    pytest.importorskip("fastapi")
    from hsdp.serve.cli import UsageError, build_parser, check_args

    cache, snap = hub_wan
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(["tiny/wan22", "--use-hsdp", "--hsdp-shard-size", "2"])
    folder, config = check_args(args)
    assert Path(args.model) == snap and args.served_model_name == "tiny/wan22" and config.world_size == 2
    args = build_parser().parse_args(["tiny/missing"])
    with pytest.raises(UsageError, match="hf download tiny/missing"):
        check_args(args)
