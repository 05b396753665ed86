"""What bench/gpu_check.py and bench/gpu_check_multi.py share: getting hsdp (and the fake
CUDA/NCCL library) built on a machine that has only a Python with torch, running each step
in a process of its own with its own time limit, the JSON written after every step, and the
summary table.

Nothing here imports hsdp, numpy or torch at module level: the parent process of a check
must run before hsdp is built, and never touches the GPU itself (a context of its own on GPU
0 would skew the memory steps and the stray-context check). The steps' processes import what
they need.

Verdicts: PASS, FAIL, ERROR (the step raised, or its process died), TIMEOUT (killed at its
limit), SKIPPED (with a reason: diffusers missing, needs 2 GPUs, ...) and DRY (a --dry-run
step whose GPU half cannot run on the fake; its fake half still checked what it could).
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import faulthandler
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PYDIR = ROOT / "python"
FAKE = ROOT / "csrc" / "tests" / "bin" / "fake_cuda_nccl.so"

VERDICTS = ("PASS", "FAIL", "ERROR", "TIMEOUT", "SKIPPED", "DRY")
DRY_OK = ("PASS", "SKIPPED", "DRY")  # what a dry run may end in
EXIT_GRACE_S = 20.0  # a step's process that wrote its result and is still there after this is hung
# for the tests of the check itself, a comma-separated list of: "<step>": that step's process
# aborts; "hang:<step>": it hangs (killed at its limit); "parent:<step>": the check itself dies
# before that step
CRASH_ENV = "HSDP_GPU_CHECK_CRASH"
# the defaults a step runs with unless the user set them: a hang ends in a minute with
# hsdp's own message, and NCCL says what went wrong without flooding the log
STEP_ENV_DEFAULTS = {"HSDP_TIMEOUT": "60", "NCCL_DEBUG": "WARN"}
# the fake's own bugs-to-be-fixed: a dry run's step whose fake half shows a finding that is
# already filed ends DRY with the finding named, not FAIL (a fixed one says so)
class Skipped(Exception):
    """A step that cannot run here, for a reason the summary shows (diffusers missing, ...)."""


# ---------------------------------------------------------------------------- small helpers
def figure(value: float | None, fmt: str = "{:.3g}", unit: str = "") -> str:
    """A step's headline number as the summary prints it ("-" when there is none)."""
    return "-" if value is None else fmt.format(value) + unit


def tail(text: str, n: int = 2500) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Written to a temporary name and renamed, so a reader (or a crash) never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, path)


def run_quiet(cmd: list[str], timeout: float = 30, **kw: Any) -> tuple[int, str]:
    """(exit status, output) of a short command; (127, why) when it cannot start."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, f"{type(exc).__name__}: {exc}"
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def step_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a step's process: this tree's hsdp first on the path, the step
    defaults where the user set nothing, unbuffered output (a killed step keeps its lines)."""
    env = dict(os.environ)
    for k, v in STEP_ENV_DEFAULTS.items():
        env.setdefault(k, v)
    env["PYTHONPATH"] = os.pathsep.join([str(PYDIR), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


# ---------------------------------------------------------------------------- building
def _newest(paths: Iterable[Path]) -> float:
    return max((p.stat().st_mtime for p in paths if p.is_file()), default=0.0)


def _sources() -> list[Path]:
    return [*ROOT.glob("csrc/**/*.c"), *ROOT.glob("csrc/**/*.h"), ROOT / "csrc" / "sources.mk", ROOT / "setup.py"]


def compiler() -> dict[str, Any]:
    """The C compiler setuptools will use (CC, else cc/gcc) and whether Python.h is there."""
    cc = os.environ.get("CC", "").split()[:1] or [shutil.which("cc") or shutil.which("gcc") or ""]
    found = bool(cc[0]) and shutil.which(cc[0]) is not None
    rc, out = run_quiet([cc[0], "--version"]) if found else (127, "no C compiler (cc, gcc) on PATH")
    include = Path(sysconfig.get_paths()["include"])
    return {"cc": cc[0] or None, "cc_version": out.splitlines()[0] if rc == 0 and out else out,
            "python_h": (include / "Python.h").is_file(), "python_include": str(include)}


def hsdp_extension() -> tuple[Path | None, str]:
    """(the built extension under python/hsdp, None when absent or stale; why)."""
    built = sorted((PYDIR / "hsdp").glob("_C*.so"), key=lambda p: p.stat().st_mtime)
    if not built:
        return None, "hsdp's extension (python/hsdp/_C*.so) is not built in this tree"
    if built[-1].stat().st_mtime < _newest(_sources()):
        return None, f"{built[-1].name} is older than the sources in csrc/"
    return built[-1], f"{built[-1].name} is up to date"


def hsdp_importable() -> tuple[bool, str]:
    """Whether this interpreter imports hsdp and its extension from this tree (a fresh process:
    the parent never imports hsdp)."""
    code = "import hsdp, hsdp._C as c; print(c.__file__)"
    rc, out = run_quiet([sys.executable, "-c", code], timeout=120, env=step_env(), cwd=str(ROOT))
    if rc != 0:
        return False, tail(out, 600)
    where = Path(out.splitlines()[-1]).resolve()
    return where.is_relative_to(PYDIR.resolve()), str(where)


def build_hsdp(log: Path) -> dict[str, Any]:
    """hsdp built from this tree unless it already is (and importable from it): ``setup.py
    build_ext --inplace`` with this interpreter, no network and no build isolation (torch
    brought setuptools; numpy must be there), the extension beside the package in python/hsdp,
    found through PYTHONPATH. Returns what happened, with "ok"."""
    so, why = hsdp_extension()
    if so is not None:
        ok, where = hsdp_importable()
        if ok:
            return {"ok": True, "built": False, "why": f"already built and importable: {where}"}
        why = f"built but not importable from this tree: {where}"
    cc = compiler()
    missing = [name for name, there in (("a C compiler", cc["cc"]), ("Python.h", cc["python_h"])) if not there]
    for mod in ("setuptools", "numpy"):
        rc, _ = run_quiet([sys.executable, "-c", f"import {mod}"])
        if rc != 0:
            missing.append(f"the Python module {mod}")
    if missing:
        return {"ok": False, "built": False,
                "why": f"cannot build hsdp ({why}): missing {', '.join(missing)}"}
    jobs = str(max(1, min(os.cpu_count() or 1, 16)))
    cmd = [sys.executable, "setup.py", "build_ext", "--inplace", "-j", jobs]
    t0 = time.monotonic()
    with open(log, "w") as out:
        out.write(f"$ {' '.join(cmd)}   # {why}\n")
        out.flush()
        try:
            rc = subprocess.run(cmd, cwd=str(ROOT), stdout=out, stderr=subprocess.STDOUT, timeout=600,
                                env={**os.environ, "PYTHONPATH": ""}).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    seconds = round(time.monotonic() - t0, 1)
    if rc != 0:
        return {"ok": False, "built": False, "seconds": seconds,
                "why": f"'{' '.join(cmd)}' failed with {rc}: {tail(log.read_text(errors='replace'), 1500)}"}
    ok, where = hsdp_importable()
    return {"ok": ok, "built": True, "seconds": seconds, "command": " ".join(cmd),
            "why": f"built in {seconds} s ({why}): {where}"}


def build_fake(path: Path) -> dict[str, Any]:
    """The fake CUDA/NCCL library (csrc/tests/fake_cuda_nccl.c) for a dry run, compiled as the
    Makefile does when it is missing or older than its sources (renamed into place, so two
    checks building at once never load half a file)."""
    deps = [ROOT / "csrc" / "tests" / "fake_cuda_nccl.c", *ROOT.glob("csrc/*.h")]
    if path.is_file() and path.stat().st_mtime >= _newest(deps):
        return {"ok": True, "built": False, "why": f"up to date: {path}"}
    cc = compiler()["cc"] or "gcc"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    cmd = [cc, "-std=c11", "-O1", "-fPIC", "-shared", f"-I{ROOT / 'csrc'}", str(deps[0]), "-o", str(tmp), "-lpthread"]
    rc, out = run_quiet(cmd, timeout=300)
    if rc != 0:
        return {"ok": False, "built": False, "why": f"'{' '.join(cmd)}' failed with {rc}: {tail(out, 1500)}"}
    os.replace(tmp, path)
    return {"ok": True, "built": True, "why": f"built: {path}"}


# ---------------------------------------------------------------------------- versions
def _c_version(lib: str, fn: str, nargs: int = 1) -> tuple[int, ...] | None:
    """The ints a C version query writes (cudaRuntimeGetVersion(&v), nvrtcVersion(&a, &b), ...)."""
    try:
        handle = ctypes.CDLL(lib)
        outs = [ctypes.c_int() for _ in range(nargs)]
        if getattr(handle, fn)(*[ctypes.byref(o) for o in outs]) != 0:
            return None
        return tuple(o.value for o in outs)
    except (OSError, AttributeError):
        return None


def _cuda_version(v: tuple[int, ...] | None) -> str | None:
    return None if v is None else f"{v[0] // 1000}.{v[0] % 1000 // 10}"


def _mapped(prefix: str) -> str | None:
    """The path of the first mapped library whose name starts with prefix (torch's copies)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                if Path(path).name.startswith(prefix):
                    return path
    except OSError:
        pass
    return None


def versions(dry: bool) -> dict[str, Any]:
    """What a first run should print: Python, numpy, torch and its CUDA, the driver, the CUDA
    runtime, NCCL and NVRTC hsdp would open, the GPUs, diffusers. Run in a step's process: it
    makes a CUDA context on a GPU."""
    import importlib.metadata
    import importlib.util

    import numpy
    import torch

    out: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable,
                           "numpy": numpy.__version__, "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    out["diffusers"] = importlib.metadata.version("diffusers") if importlib.util.find_spec("diffusers") else None
    rc, smi = run_quiet(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total,compute_cap",
                         "--format=csv,noheader"])
    out["nvidia_smi"] = smi.splitlines() if rc == 0 else f"unavailable: {smi[:200]}"
    out["driver_cuda"] = _cuda_version(_c_version("libcuda.so.1", "cuDriverGetVersion"))
    gpus = torch.cuda.device_count() if not dry else 0
    out["gpus"] = [{"name": torch.cuda.get_device_name(i),
                    "capability": "sm_%d%d" % torch.cuda.get_device_capability(i),
                    "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
                   for i in range(gpus)]
    if gpus:
        torch.cuda.init()  # maps torch's libcudart, whose version is the runtime hsdp shares
    cudart = _mapped("libcudart.so")
    out["cuda_runtime"] = {"path": cudart, "version": _cuda_version(_c_version(cudart, "cudaRuntimeGetVersion"))
                           if cudart else None}
    try:
        nccl_v = torch.cuda.nccl.version()
        out["torch_nccl"] = ".".join(map(str, nccl_v)) if isinstance(nccl_v, tuple) else str(nccl_v)
    except Exception as exc:  # a CPU-only torch has none
        out["torch_nccl"] = f"unavailable: {exc}"[:200]
    try:
        from hsdp.world import nccl

        lib, rt = nccl.library_paths()
        v = _c_version(lib, "ncclGetVersion")
        out["hsdp_nccl"] = {"path": lib, "version": None if v is None else
                            f"{v[0] // 10000}.{v[0] // 100 % 100}.{v[0] % 100}", "cudart": rt}
    except Exception as exc:
        out["hsdp_nccl"] = f"unavailable: {type(exc).__name__}: {exc}"[:300]
    try:
        from hsdp.world import nccl

        nvrtc = nccl.wire_kernel_paths()[0]
        v = _c_version(nvrtc, "nvrtcVersion", 2)
        out["nvrtc"] = {"path": nvrtc, "version": None if v is None else f"{v[0]}.{v[1]}"}
    except Exception as exc:
        out["nvrtc"] = f"unavailable: {type(exc).__name__}: {exc}"[:300]
    import hsdp
    from hsdp import _C

    out["hsdp"] = {"package": str(Path(hsdp.__file__).parent), "extension": _C.__file__,
                   "backends": [list(b) for b in _C.backends()]}
    return out


# ---------------------------------------------------------------------------- a step's process
def _injected(what: str) -> bool:
    return what in os.environ.get(CRASH_ENV, "").split(",")


def worker_prelude(step: str, limit_s: float) -> None:
    """First thing in a step's process: a hang prints every thread's traceback before the
    parent kills it at the limit, and the injected crash of the test happens here."""
    faulthandler.enable(all_threads=True)
    faulthandler.dump_traceback_later(max(limit_s - 5.0, 1.0), exit=False)
    # killed at the limit (torchrun passes the parent's SIGTERM on): where it was, then the end
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    if _injected(step):
        print(f"{CRASH_ENV}: aborting the process of step {step} on purpose", flush=True)
        os.abort()
    if _injected(f"hang:{step}"):
        print(f"{CRASH_ENV}: the process of step {step} hangs on purpose", flush=True)
        time.sleep(86400)


def run_step_fn(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A step's result, whatever it did: its own dict, SKIPPED with the reason, or ERROR with
    the traceback (never an exception out of here)."""
    t0 = time.monotonic()
    try:
        res = fn()
    except Skipped as exc:
        res = {"verdict": "SKIPPED", "why": str(exc)}
    except Exception as exc:  # every step reports, whatever it raised
        res = {"verdict": "ERROR", "why": f"{type(exc).__name__}: {exc}"[:1500],
               "traceback": tail(traceback.format_exc(), 3000)}
    res.setdefault("figure", "-")
    res["seconds"] = round(time.monotonic() - t0, 2)
    return res


# ---------------------------------------------------------------------------- the parent
@dataclasses.dataclass
class Job:
    """How a step's process ended."""

    rc: int | None  # its exit status; None when it was killed
    timed_out: bool  # killed at the step's limit
    exit_hung: bool  # its results were in, but it did not exit within EXIT_GRACE_S
    seconds: float
    exit_s: float | None  # from its results being in to its exit
    log: Path

    def log_tail(self, n: int = 2500) -> str:
        try:
            return tail(self.log.read_text(errors="replace"), n)
        except OSError:
            return ""


def _descendants(pid: int) -> list[int]:
    """Every process below pid (torchrun's ranks sit in sessions of their own, so killing the
    launcher's process group would miss them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGTERM to the step's process group (torchrun forwards it to its ranks), SIGKILL to
    whatever of its tree is still there 5 s later."""
    tree = _descendants(proc.pid)
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            pass
        if sig == signal.SIGKILL:
            for pid in tree:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        try:
            proc.wait(timeout=wait)
            if sig == signal.SIGTERM and not any(Path(f"/proc/{p}").exists() for p in tree):
                return
        except subprocess.TimeoutExpired:
            pass


def run_job(cmd: list[str], env: dict[str, str], limit_s: float, log: Path,
            results_in: Callable[[], bool]) -> Job:
    """Runs a step's process (a session of its own) until it exits, its limit passes (killed:
    TIMEOUT), or it outlives its results by EXIT_GRACE_S (killed: hung at exit)."""
    t0 = time.monotonic()
    seen: float | None = None
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        timed_out = hung = False
        while proc.poll() is None:
            now = time.monotonic()
            if seen is None and results_in():
                seen = now
            if seen is not None and now - seen > EXIT_GRACE_S:
                hung = True
            elif now - t0 > limit_s:
                timed_out = True
            if hung or timed_out:
                _kill_tree(proc)
                break
            time.sleep(0.05)  # polling the child and its result files; nothing to wait on
    end = time.monotonic()
    if seen is None and results_in():
        seen = end
    return Job(rc=None if hung or timed_out else proc.returncode, timed_out=timed_out, exit_hung=hung,
               seconds=round(end - t0, 2), exit_s=None if seen is None or hung else round(end - seen, 2), log=log)


def died(job: Job, what: str = "the step's process") -> dict[str, Any]:
    """The result of a step whose process gave none: TIMEOUT, or ERROR with how it ended."""
    if job.timed_out:
        return {"verdict": "TIMEOUT", "why": f"{what} was killed at its time limit (after {job.seconds:.0f} s)",
                "log_tail": job.log_tail()}
    rc = job.rc
    how = f"signal {signal.Signals(-rc).name}" if rc is not None and rc < 0 else f"exit status {rc}"
    return {"verdict": "ERROR", "why": f"{what} ended ({how}) without a result", "log_tail": job.log_tail()}


@dataclasses.dataclass
class Report:
    """The JSON of a check, rewritten after every step, and its summary table."""

    script: str
    path: Path
    mode: str
    budget_s: float
    started: float = dataclasses.field(default_factory=time.monotonic)
    doc: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.doc = {"script": self.script, "mode": self.mode, "argv": sys.argv,
                    "started": datetime.datetime.now().isoformat(timespec="seconds"), "budget_s": self.budget_s,
                    "complete": False, "written_after": [], "steps": {}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.save()

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def save(self) -> None:
        self.doc["elapsed_s"] = round(time.monotonic() - self.started, 1)
        write_json(self.path, self.doc)

    def add(self, name: str, res: dict[str, Any]) -> None:
        """One step's result: printed as a line, and the JSON rewritten at once."""
        assert res.get("verdict") in VERDICTS, res
        self.doc["steps"][name] = res
        self.doc["written_after"].append(name)
        self.save()
        why = res.get("why", "")
        print(f"{name:<22} {res['verdict']:<8} {str(res.get('figure', '-')):<24} {why[:200]}", flush=True)
        for key, value in (res.get("versions") or {}).items():  # the preflight's, in full
            print(f"    {key}: {json.dumps(value, default=str)[:300]}", flush=True)
        if res["verdict"] in ("FAIL", "ERROR", "TIMEOUT") and res.get("log_tail"):
            print("    | " + res["log_tail"][-1200:].replace("\n", "\n    | "), flush=True)

    def finish(self) -> int:
        """The summary table; exit status 0 when nothing failed, raised or hung."""
        self.doc["complete"] = True
        self.save()
        steps = self.doc["steps"]
        print(f"\n{self.script} summary ({self.mode}; {self.doc['elapsed_s']} s; JSON: {self.path})")
        print(f"{'step':<22} {'verdict':<8} {'figure':<24} {'s':>6}  note")
        for name, r in steps.items():
            note = "" if r["verdict"] == "PASS" else str(r.get("why", ""))[:90]
            print(f"{name:<22} {r['verdict']:<8} {str(r.get('figure', '-'))[:24]:<24} "
                  f"{r.get('seconds', 0):>6.1f}  {note}")
        counts = {v: sum(r["verdict"] == v for r in steps.values()) for v in VERDICTS}
        print("  ".join(f"{v} {n}" for v, n in counts.items() if n))
        bad = counts["FAIL"] + counts["ERROR"] + counts["TIMEOUT"]
        return 1 if bad else 0


def json_path(script: str, given: Path | None) -> Path:
    """--json PATH, else $OUT/<script>.json, else a fresh temporary folder's."""
    if given is not None:
        return given
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / f"{script}.json"
    return Path(tempfile.mkdtemp(prefix=f"{script}.")) / f"{script}.json"


def crash_parent_before(step: str) -> None:
    """HSDP_GPU_CHECK_CRASH=parent:<step>: the check itself dies before that step (the test
    that the JSON on disk already holds every earlier step)."""
    if _injected(f"parent:{step}"):
        print(f"{CRASH_ENV}: the check dies before step {step} on purpose", flush=True)
        os._exit(3)


def preflight(report: Report, dry: bool, fake: Path, logs: Path) -> bool:
    """Builds hsdp (and, for a dry run, the fake library) as needed and records it as the
    step "build"; False when nothing else can run."""
    t0 = time.monotonic()
    cc = compiler()
    res: dict[str, Any] = {"compiler": cc}
    hsdp = build_hsdp(logs / "build.log")
    res["hsdp"] = hsdp
    ok = hsdp["ok"]
    if dry:
        res["fake"] = build_fake(fake) if cc["cc"] else {"ok": fake.is_file(), "why": "no C compiler"}
        ok = ok and res["fake"]["ok"]
    res["verdict"] = "PASS" if ok else "ERROR"
    tools = f"{cc['cc_version'] if cc['cc'] else 'no C compiler'}; Python.h {'found' if cc['python_h'] else 'MISSING'}"
    res["why"] = "; ".join([tools, *(x["why"] for x in (res["hsdp"], res.get("fake")) if x)])
    res["figure"] = ("built" if hsdp.get("built") else "ready") if ok else "no hsdp"
    res["seconds"] = round(time.monotonic() - t0, 1)
    report.add("build", res)
    return ok
