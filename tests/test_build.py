"""Builds with and without MPI coexist in one checkout: switching rebuilds the extension with
the new flags (no manual clean), and a build of an unchanged variant compiles nothing. And a
wheel built where no CUDA toolkit or header is visible has the NCCL backend all the same."""

from __future__ import annotations

import glob
import os
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
from mpirun import ROOT


def _copy_sources(dst: Path) -> None:
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dst / name)
    shutil.copytree(ROOT / "csrc", dst / "csrc", ignore=shutil.ignore_patterns("bin", "*.o"))
    shutil.copytree(ROOT / "python", dst / "python", ignore=shutil.ignore_patterns("*.so", "__pycache__"))


def _build(where: Path, no_mpi: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != "HSDP_NO_MPI"}
    if no_mpi:
        env["HSDP_NO_MPI"] = "1"
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=where, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def _mpi_usable(where: Path) -> bool:
    code = "import hsdp._C as C; print(dict((n, u) for n, u, _ in C.backends())['mpi'])"
    out = subprocess.run([sys.executable, "-c", code], cwd=where, env={**os.environ, "PYTHONPATH": "python"},
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return out.strip() == "True"


def test_switching_mpi_and_no_mpi_builds_needs_no_clean(tmp_path: Path) -> None:
    _copy_sources(tmp_path)
    _build(tmp_path, no_mpi=True)
    assert not _mpi_usable(tmp_path)
    _build(tmp_path, no_mpi=False)  # the flags changed: a real rebuild, not "up to date"
    assert _mpi_usable(tmp_path)
    again = _build(tmp_path, no_mpi=False)
    assert " -c csrc/" not in again  # same variant: nothing recompiled
    # the NCCL backend is in every build: no variant of its own unless forced off
    assert sorted(p.name for p in tmp_path.glob("build/temp*/*") if p.is_dir()) == ["mpi", "nompi"]


# ---------------------------------------------------------------------------- no CUDA toolkit
def _header_dirs() -> list[Path]:
    """Every place a CUDA toolkit's or NCCL's headers are found here: the CUDA toolkits under
    /usr/local, and the include folders of the nvidia wheels torch brings (and triton's)."""
    dirs = {Path(p).resolve() for p in glob.glob("/usr/local/cuda*") if Path(p).resolve().is_dir()}
    for site_dir in {*site.getsitepackages(), *sys.path}:
        for pattern in ("nvidia/*/include", "triton/backends/nvidia/include"):
            dirs.update(Path(p).resolve() for p in glob.glob(os.path.join(site_dir, pattern)) if Path(p).is_dir())
    return sorted(dirs)


def _can_unshare() -> str | None:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return "hiding the CUDA headers needs root and unshare (a private mount namespace)"
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"unshare -m is refused here: {probe.stderr.strip()}"


# Run as one script in a private mount namespace, where an empty folder is mounted over each
# header folder: check that no header is visible, build a wheel, install it into a target,
# and ask it for NCCL.
_HIDDEN_BUILD = r"""
set -e
for d in "$@"; do mount --bind "$EMPTY" "$d"; done
test -z "$("$PY" "$SRC/csrc/cuda_headers.py")" || { echo "headers still visible"; exit 3; }
for h in nccl.h cuda_runtime_api.h; do
  if echo "#include <$h>" | cc -fsyntax-only -x c - 2>/dev/null; then echo "cc still finds $h"; exit 3; fi
done
echo "HIDDEN $#"
"$PY" -m pip wheel -q --no-build-isolation --no-deps --no-index -w "$DIST" "$SRC"
"$PY" -m pip install -q --no-deps --no-index --target "$TARGET" "$DIST"/hsdp-*.whl
cd "$DIST" && PYTHONPATH="$TARGET" "$PY" - <<'PYEOF'
import hsdp
from hsdp import _C
from hsdp.world import nccl
print("FROM", _C.__file__)
print("BUILT", _C.nccl_built(), [name for name, _, _ in _C.backends()])
import torch
try:
    nccl.load()
    print("LOADED", _C.nccl_version(), "GPU", torch.cuda.is_available())
except Exception as exc:  # the no-GPU error, whatever its Python type
    print("REFUSED", "GPU", torch.cuda.is_available(), "ERR", exc)
PYEOF
"""


def test_wheel_without_cuda_headers_has_the_nccl_backend(tmp_path: Path) -> None:
    """With every CUDA toolkit and nvidia header folder hidden (a mount namespace), the wheel
    still builds the NCCL backend: installed into a target, it lists it as built, and on a
    machine with no GPU asking for it fails only then, saying there is no GPU."""
    why = _can_unshare()
    if why:
        pytest.skip(why)
    hide = _header_dirs()  # none on a machine without them: the script still checks that none is visible
    src, dist, target, empty = (tmp_path / n for n in ("src", "dist", "target", "empty"))
    for d in (src, dist, empty):
        d.mkdir()
    _copy_sources(src)
    env = {k: v for k, v in os.environ.items()
           if k not in ("HSDP_CUDA_HOME", "HSDP_NO_NCCL", "HSDP_TEST_BACKENDS", "CPATH", "C_INCLUDE_PATH", "PYTHONPATH")}
    env.update(PY=sys.executable, SRC=str(src), DIST=str(dist), TARGET=str(target), EMPTY=str(empty))
    proc = subprocess.run(["unshare", "-m", "sh", "-c", _HIDDEN_BUILD, "sh", *map(str, hide)], env=env,
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"HIDDEN {len(hide)}" in out
    assert f"FROM {target}" in out, out  # the installed wheel, not this checkout
    assert "BUILT True ['single', 'mpi', 'nccl']" in out, out  # the test-only fakedev is in no wheel
    if "GPU True" in out:
        assert re.search(r"LOADED \d+ GPU True", out), out
    else:
        assert re.search(r"REFUSED GPU False ERR no usable GPU for the NCCL backend: cudaGetDeviceCount failed "
                         r"with CUDA error \d+ \(", out), out
