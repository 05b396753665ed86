"""torch.compile on models hsdp has sharded (issue 38): torch.compile(model) and diffusers'
compile_repeated_blocks() equal the eager sharded model over 2 real ranks, in every layout,
and recompile nothing in steady state (tests/compile_worker.py says what each case checks);
the hooks stay out of the graphs ([Note: compile] in hsdp.adapters.torch). Also the flags,
the folder check for --compile regional, and hsdp serve's job record of the warm-up."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")  # torch is an optional dependency; make test installs it
pytest.importorskip("diffusers")

from mpirun import run_ranks  # noqa: E402

from hsdp.testing.tiny_pipeline import make_tiny_pipeline  # noqa: E402

# Inductor on the HSDP Wan (the backend users get); the other cases on aot_eager (Dynamo and
# AOTAutograd: where the parameters meet the graphs; Inductor's C++ builds would cost minutes)
@pytest.fixture(scope="module")
def wan22(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_pipeline(tmp_path_factory.mktemp("compile") / "wan22", "wan22", seed=0)


MODEL_CASES = ["wan:hsdp:inductor", "flux:hsdp", "wan:ulysses", "flux:ulysses", "wan:ring", "wan:residency",
               "wan:wire"]


def test_compiled_sharded_models_and_pipeline_equal_eager_without_recompiles(wan22):
    """Wan and Flux in float32 over HSDP 1x2 and Ulysses 2 (Wan over ring 2 too), each
    compiled whole and regionally: equal to eager within 1e-5 on every forward, no recompile
    after the warm-up across an explicit unshard, a reshard and hsdp.resident; Wan with a
    residency budget (units kept from the second forward on) and with the float8 wire; the
    tiny Wan 2.2 pipeline with both experts compiled whole, over HSDP 1x2, CFG parallel 2
    (guidance on) and two data-parallel lanes (two prompts), two requests each, the second
    under error_on_recompile, frames within 1e-5 of the same pipeline eager."""
    out = run_ranks(2, "tests/compile_worker.py", *MODEL_CASES, f"pipeline:{wan22}", f"pipeline-cfg:{wan22}",
                    f"pipeline-dp:{wan22}", timeout=600).stdout
    for what in ("wan hsdp whole (inductor)", "wan hsdp regional (inductor)", "flux hsdp whole (aot_eager)",
                 "flux hsdp regional (aot_eager)", "wan ulysses whole", "wan ulysses regional", "flux ulysses whole",
                 "flux ulysses regional", "wan ring whole", "wan ring regional", "wan residency", "wan wire",
                 "pipeline hsdp", "pipeline cfg", "pipeline dp"):
        assert out.count(f"compile {what}") == 2, (what, out)


def test_compile_flags_and_their_defaults(wan22):
    """--compile takes regional, whole or none; --enforce-eager is none and contradicts the
    other two; the default is regional on GPUs, none on CPU ranks; bad values exit 2 before
    anything starts, naming the flag."""
    import argparse
    import subprocess
    import sys

    from hsdp.cli.compile_mode import resolve_compile

    def ns(**kw):
        return argparse.Namespace(**{"compile": None, "enforce_eager": False, **kw})

    assert resolve_compile(ns(), on_gpu=True) == "regional"
    assert resolve_compile(ns(), on_gpu=False) == "none"
    assert resolve_compile(ns(compile="whole"), on_gpu=False) == "whole"
    assert resolve_compile(ns(enforce_eager=True), on_gpu=True) == "none"
    assert resolve_compile(ns(enforce_eager=True, compile="none"), on_gpu=True) == "none"
    with pytest.raises(ValueError, match="--enforce-eager runs eagerly, and --compile whole compiles"):
        resolve_compile(ns(enforce_eager=True, compile="whole"), on_gpu=False)
    for command in ("generate", "serve"):
        for flags, message in ((["--compile", "bogus"], "argument --compile: invalid choice: 'bogus'"),
                               (["--compile", "regional", "--enforce-eager"], "--enforce-eager runs eagerly")):
            line = [sys.executable, "-m", "hsdp", command, "--model", str(wan22), *flags]
            proc = subprocess.run(line + (["--prompt", "x"] if command == "generate" else []), capture_output=True,
                                  check=False, text=True, timeout=60)
            assert proc.returncode == 2 and message in proc.stderr, (command, flags, proc.returncode, proc.stderr)


def test_compile_folder_check_refuses_regional_without_repeated_blocks(wan22, tmp_path):
    """check_compile_folder, from the folder's JSON alone: regional is refused, naming the
    transformer and its class, when that class (diffusers') names no _repeated_blocks; the
    tiny Wan 2.2's WanTransformer3DModel passes, and whole and none pass any class."""
    import json
    import shutil

    from hsdp.cli.compile_mode import check_compile_folder
    from hsdp.cli.folder import read_folder

    check_compile_folder("regional", read_folder(wan22))
    folder = tmp_path / "no-blocks"
    shutil.copytree(wan22, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    index = folder / "model_index.json"  # the class a pipeline's from_pretrained loads a component as
    entries = json.loads(index.read_text())
    index.write_text(json.dumps({**entries, "transformer_2": ["diffusers", "CogVideoXTransformer3DModel"]}))
    assert not getattr(__import__("diffusers").CogVideoXTransformer3DModel, "_repeated_blocks", None)
    with pytest.raises(ValueError, match=r"transformer_2 \(CogVideoXTransformer3DModel\) names none .*--compile whole"):
        check_compile_folder("regional", read_folder(folder))
    for mode in ("whole", "none"):
        check_compile_folder(mode, read_folder(folder))
    with pytest.raises(ValueError, match="--compile must be one of regional, whole, none, got 'fast'"):
        check_compile_folder("fast", read_folder(folder))


def test_serve_shows_the_compile_warm_up_in_the_job_record(wan22, tmp_path):
    """hsdp serve --compile whole over 2 ranks: the first job's record says it is compiling
    while its first forward runs, then holds the warm-up (compile seconds, the transformers
    compiled, its first step against the later ones); the second job's says no warm-up and
    nothing compiled."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from mpirun import MPI_ENV, ROOT

    env = {**os.environ, **MPI_ENV,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    for name in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "RANK", "WORLD_SIZE"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "hsdp", "serve", str(wan22), "--port", "0", "--use-hsdp", "--hsdp-shard-size", "2",
           "--dtype", "float32", "--compile", "whole", "--output-dir", str(tmp_path / "out")]
    err = (tmp_path / "serve.err").open("w")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "ready:" in line:
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()

    def log() -> str:
        return "".join(lines) + "--- stderr\n" + (tmp_path / "serve.err").read_text()

    try:
        assert ready.wait(240) and proc.poll() is None, log()
        url = next(line.split("listening on ")[1].split()[0] for line in lines if "listening on " in line)
        form = {"width": "32", "height": "32", "num_frames": "5", "num_inference_steps": "4", "seed": "1"}
        with httpx.Client(base_url=url, timeout=60) as client:
            records = []
            for prompt in ("a cat running in the snow", "a red boat on a lake"):
                job = client.post("/v1/videos", data={**form, "prompt": prompt}).json()
                seen: list[dict] = []
                deadline = time.monotonic() + 120
                while job["status"] in ("queued", "in_progress") and time.monotonic() < deadline:
                    time.sleep(0.05)
                    job = client.get(f"/v1/videos/{job['id']}").json()
                    if "compile" in job:
                        seen.append(job["compile"])
                assert job["status"] == "completed", (job, log())
                records.append((job["compile"], seen))
        (first, seen1), (second, seen2) = records
        base = {"mode": "whole", "transformers": ["transformer", "transformer_2"]}
        assert any(s.get("compiling") == "transformer" for s in seen1), seen1  # the warm-up, as it ran
        assert first["warm_up"] is True and first["compile_seconds"] > 0, first
        assert first.items() >= base.items() and "transformer" in first["compiled"], first
        assert first["compiled"]["transformer"]["compile_seconds"] > 0, first
        assert first["first_step_seconds"] > first["later_step_seconds"], first  # the first step waited
        assert not any("compiling" in s for s in seen2), seen2
        assert second.items() >= base.items(), second
        assert second["warm_up"] is False and second["compile_seconds"] == 0 and second["compiled"] == {}, second
        assert "waited for the compile warm-up (--compile whole)" in (tmp_path / "serve.err").read_text(), log()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        err.close()
