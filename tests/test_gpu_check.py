"""bench/gpu_check.py and bench/gpu_check_multi.py stand alone (issue 30): from a fresh copy of
this checkout's files, in a virtual environment that has only torch and numpy (and what torch
itself needs: setuptools among it; no hsdp, no diffusers), each ``--dry-run`` builds hsdp
itself (and the fake CUDA/NCCL library with the C compiler) and ends with every step PASS,
SKIPPED (with a reason) or DRY; its JSON is rewritten after every step, and a step that
crashes or hangs loses only itself.

The copy and the environment are made once for the file (a module fixture): the first dry
run builds in the copy, the others find it built. The environment is a ``venv`` without pip
whose site-packages holds one .pth file naming a folder of symbolic links to the
distributions torch and numpy need, taken from this interpreter's own site-packages.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("numpy")

ROOT = Path(__file__).resolve().parent.parent
DRY_OK = {"PASS", "SKIPPED", "DRY"}
# what the bare environment holds: torch and numpy with their requirements, and setuptools,
# which torch requires only from Python 3.12 on (hsdp's build needs it)
ROOTS = ("torch", "numpy", "setuptools")


@dataclass(frozen=True)
class Bare:
    root: Path  # the copy of the checkout
    python: Path  # the bare environment's interpreter


def _name(req: str) -> str:
    return re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0].lower().replace("_", "-")


def _distributions(roots: tuple[str, ...]) -> list[importlib.metadata.Distribution]:
    """roots and everything they require (requirements of an extra left out; a requirement
    for another platform is simply not installed, so it drops out)."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        name = _name(todo.pop())
        if name in seen:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        seen[name] = dist
        todo += [r for r in dist.requires or [] if "extra ==" not in r]
    return list(seen.values())


def _top_levels(dist: importlib.metadata.Distribution) -> set[Path]:
    """The entries of site-packages a distribution installed (packages, modules, its
    dist-info), as absolute paths; its scripts (outside site-packages) left out."""
    out = set()
    for f in dist.files or []:
        parts = Path(f).parts
        if parts and parts[0] not in ("..", "__pycache__"):
            out.add(Path(dist.locate_file(parts[0])))
    return {p for p in out if p.exists()}


def _copy_checkout(dest: Path) -> None:
    """The files a fresh clone of this checkout would have (tracked, and untracked ones git
    does not ignore), as they are now: no build outputs, no fake library, no venv."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, timeout=60)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.decode(errors='replace')[:200]}")
    for rel in filter(None, listed.stdout.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel, follow_symlinks=False)


def _bare_env(**extra: str) -> dict[str, str]:
    """The environment of a run in the bare venv: nothing of this test's Python (its path,
    venv, user site) and no launcher's variables."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
            "MASTER_PORT", "OUT", "HSDP_TIMEOUT", "CUDA_VISIBLE_DEVICES")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("OMPI_", "PMI", "PMIX_", "TORCHELASTIC_", "FAKE_", "HSDP_"))}
    env["PYTHONNOUSERSITE"] = "1"
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Bare:
    if shutil.which("git") is None:
        pytest.skip("git is needed to list the checkout's files")
    base = tmp_path_factory.mktemp("bare")
    root = base / "clone"
    _copy_checkout(root)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=60, env=_bare_env()).stdout.strip()
    only = base / "only"
    only.mkdir()
    for dist in _distributions(ROOTS):
        for top in _top_levels(dist):
            if not (only / top.name).exists():
                (only / top.name).symlink_to(top)
    Path(site, "torch_and_numpy_only.pth").write_text(f"{only}\n")
    return Bare(root=root, python=python)


def _run(bare: Bare, script: str, *args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(bare.python), f"bench/{script}", *args], cwd=bare.root, capture_output=True,
                          text=True, timeout=timeout, env=_bare_env(**env))


def _check_dry_run(proc: subprocess.CompletedProcess, doc: dict[str, Any], script: str) -> None:
    """Exit 0; every step PASS, SKIPPED (with a reason) or DRY; the JSON complete and written
    after every step, in order; the summary table names every step."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    steps = doc["steps"]
    assert doc["complete"] and doc["mode"] == "dry-run", out
    assert doc["written_after"] == list(steps), doc["written_after"]
    bad = {k: (s["verdict"], s.get("why")) for k, s in steps.items() if s["verdict"] not in DRY_OK}
    assert not bad, out
    for name, s in steps.items():
        if s["verdict"] == "SKIPPED":
            assert s.get("why"), (name, s)
    table = proc.stdout.split(f"{script} summary", 1)[1]
    for name, s in steps.items():
        assert re.search(rf"^{name}\s+{s['verdict']}\s", table, re.M), table


def test_the_bare_environment_has_only_torch_and_numpy(bare: Bare) -> None:
    probe = ("import importlib.util as u, sys; import torch, numpy, setuptools; "
             "print(sorted(m for m in ('diffusers', 'hsdp', 'pytest', 'transformers') if u.find_spec(m)))")
    proc = subprocess.run([str(bare.python), "-c", probe], capture_output=True, text=True, timeout=120,
                          env=_bare_env(), cwd=bare.root.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout
    no = subprocess.run([str(bare.python), "-c", "import diffusers"], capture_output=True, text=True, timeout=60,
                        env=_bare_env())
    assert no.returncode != 0 and "ModuleNotFoundError" in no.stderr, no.stderr
    assert not list((bare.root / "python" / "hsdp").glob("_C*.so")), "the copy came with a built extension"


def test_gpu_check_dry_run_from_a_fresh_copy(bare: Bare, tmp_path: Path) -> None:
    """The one-GPU check: it builds hsdp and the fake library itself (when the copy has
    neither), and every step passes, runs its fake half (DRY) or says why it is skipped."""
    proc = _run(bare, "gpu_check.py", "--dry-run", OUT=str(tmp_path))
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    _check_dry_run(proc, doc, "gpu_check")
    steps = doc["steps"]
    build = steps["build"]
    assert build["verdict"] == "PASS" and build["compiler"]["python_h"], build
    assert list((bare.root / "python" / "hsdp").glob("_C*.so")), build
    assert (bare.root / "csrc" / "tests" / "bin" / "fake_cuda_nccl.so").is_file(), build
    assert steps["parity_wan"]["verdict"] == "SKIPPED" and "diffusers missing" in steps["parity_wan"]["why"]
    assert steps["preflight"]["versions"]["diffusers"] is None, steps["preflight"]
    for name in ("ordering", "split", "clean_exit"):  # what the fake runs whole
        assert steps[name]["verdict"] == "PASS", (name, steps[name])
    for name in ("mesh", "parity_bf16", "stream_forward", "overlap", "oom_retry"):  # the fake's half held
        assert steps[name]["verdict"] == "DRY", (name, steps[name])
    assert steps["clean_exit"]["process"]["exit_after_result_s"] < 20, steps["clean_exit"]


def test_gpu_check_multi_dry_run_from_a_fresh_copy(bare: Bare, tmp_path: Path) -> None:
    """The multi-GPU check: 3 forked ranks a step; the byte checks pass on the fake, the
    bandwidth steps need GPUs (DRY), the stock Wan is skipped without diffusers."""
    proc = _run(bare, "gpu_check_multi.py", "--dry-run", OUT=str(tmp_path))
    doc = json.loads((tmp_path / "gpu_check_multi.json").read_text())
    _check_dry_run(proc, doc, "gpu_check_multi")
    steps = doc["steps"]
    assert doc["ranks"] == 3 and steps["build"]["verdict"] == "PASS", doc
    for name in ("split_ranks", "mesh", "inplace_offsets", "ring_sendrecv", "ulysses_a2a", "cfg_gather", "wire_fp8",
                 "desync_same_size", "desync_sizes"):
        assert steps[name]["verdict"] == "PASS", (name, steps[name])
    assert steps["parity_wan"]["verdict"] == "SKIPPED" and "diffusers missing" in steps["parity_wan"]["why"]
    subgroups = steps["timeout_subgroups"]
    assert subgroups["verdict"] == "DRY", subgroups
    assert all(r.get("raised", subgroups["raised"]) for r in subgroups["per_rank"].values()), subgroups
    assert (tmp_path / "gpu_check_multi" / "split_ranks.rank2.json").is_file()


def test_a_crash_or_a_hang_loses_only_its_step(bare: Bare, tmp_path: Path) -> None:
    """A step's process that aborts is an ERROR naming the signal, one that hangs is killed
    at its limit (TIMEOUT) after faulthandler printed where it hung; the steps after each
    still run. A check that dies itself leaves the JSON of every step before."""
    proc = _run(bare, "gpu_check.py", "--dry-run", "--step", "last_error", "--step", "ordering", "--step", "init",
                "--step", "split", "--step-limit", "8", OUT=str(tmp_path), HSDP_GPU_CHECK_CRASH="ordering,hang:init")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = doc["steps"]
    assert list(steps) == ["build", "preflight", "last_error", "ordering", "init", "split"], list(steps)
    assert steps["last_error"]["verdict"] == "DRY", steps["last_error"]
    assert steps["ordering"]["verdict"] == "ERROR" and "SIGABRT" in steps["ordering"]["why"], steps["ordering"]
    assert steps["init"]["verdict"] == "TIMEOUT", steps["init"]
    assert "Timeout (" in steps["init"]["log_tail"] and "worker_prelude" in steps["init"]["log_tail"], steps["init"]
    assert steps["split"]["verdict"] == "PASS", steps["split"]
    assert doc["complete"] and doc["written_after"] == list(steps)

    dead = tmp_path / "dead"
    proc = _run(bare, "gpu_check.py", "--dry-run", "--step", "last_error", "--step", "ordering",
                OUT=str(dead), HSDP_GPU_CHECK_CRASH="parent:ordering")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    doc = json.loads((dead / "gpu_check.json").read_text())
    assert not doc["complete"] and doc["written_after"] == ["build", "preflight", "last_error"], doc
    assert doc["steps"]["last_error"]["verdict"] == "DRY", doc


@pytest.mark.parametrize("script", ["gpu_check", "gpu_check_multi"])
def test_the_wan_steps_run_on_the_fake_with_diffusers(script: str, tmp_path: Path) -> None:
    """Where diffusers is installed (this interpreter, this tree), the stock-Wan step runs its
    fake half: a tiny Wan sharded on the fake's host view, bit for bit, and its float8 wire."""
    pytest.importorskip("diffusers")
    env = {k: v for k, v in _bare_env(OUT=str(tmp_path)).items() if k != "PYTHONNOUSERSITE"}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    proc = subprocess.run([sys.executable, f"bench/{script}.py", "--dry-run", "--step", "parity_wan"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wan = json.loads((tmp_path / f"{script}.json").read_text())["steps"]["parity_wan"]
    assert wan["verdict"] == "DRY" and wan["bit_exact"] and wan["fp8_wire_rel_l2"] <= 0.05, wan
