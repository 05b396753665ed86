"""``hsdp serve`` (python -m hsdp serve): a real server on 2 ranks, started as a subprocess on
127.0.0.1 (port 0: the server picks a free one and prints it), answered by a real HTTP client.

Two launches, overlapped (the Flux server loads while the video tests run): a Wan2.2 video
server (every route, the key, bad input, a failure inside the model, 8 concurrent clients, then
SIGTERM while a job runs) and a Flux image server (the images route, then a rank killed). Every wait is bounded: request loops by count and deadline, the
processes by timeouts."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from mpirun import MPI_ENV, ROOT

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("imageio_ffmpeg")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from hsdp.testing.tiny_pipeline import make_tiny_pipeline  # noqa: E402

KEY = "test-key-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}
FAULT = "bad quality static"  # the prompt that fails inside the model (HSDP_SERVE_FAULT_PROMPT)
FAULT_RANK1 = "a fault on rank 1 alone"  # ... on rank 1 only
FAULTS = f"{FAULT}|{FAULT_RANK1}@1"
LIMIT_FLAGS = ["--max-pixels", "1024", "--max-frames", "9", "--max-steps", "100", "--max-prompt-chars", "2000"]
VIDEO = {"width": "32", "height": "32", "num_frames": "5", "num_inference_steps": "2"}
RANK_VARS = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK", "PMIX_RANK",
             "MPI_LOCALNRANKS", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
START_TIMEOUT = 240.0  # loading on a busy 2-core machine
JOB_TIMEOUT = 120.0


class Server:
    """``python -m hsdp serve ... --port 0`` in a subprocess, found by a tag in its environment."""

    def __init__(self, folder: Path, tmp: Path, extra: list[str], env: dict[str, str] | None = None) -> None:
        self.tag = uuid.uuid4().hex
        # Open MPI's shared-memory segments go to a folder of this server alone, so the test can
        # see that none is left behind among the other jobs' segments in /dev/shm.
        self.shm = Path("/dev/shm") / f"hsdp-serve-test-{self.tag}"
        self.shm.mkdir()
        base = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
        base["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), *filter(None, [base.get("PYTHONPATH")])])
        self.env = {**base, **MPI_ENV, "HSDP_SERVE_TEST_TAG": self.tag,
                    "OMPI_MCA_btl_vader_backing_directory": str(self.shm), **(env or {})}
        self.stderr_path = tmp / f"serve-{self.tag}.err"
        # vllm's shape: the model first, without --model
        self.cmd = [sys.executable, "-m", "hsdp", "serve", str(folder), "--port", "0",
                    "--use-hsdp", "--hsdp-shard-size", "2", "--dtype", "float32", *extra]
        self.proc = subprocess.Popen(self.cmd, cwd=tmp, env=self.env, stdout=subprocess.PIPE,
                                     stderr=self.stderr_path.open("w"), text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stdout: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.url = ""
        self.output_dir: Path | None = None
        self.started = time.monotonic()

    def wait_ready(self) -> Server:
        if self.output_dir is not None:
            return self
        deadline = self.started + START_TIMEOUT
        while True:
            line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, f"the server exited {self.proc.wait()} before it was ready\n{self.log()}"
            if "listening on http://" in line:
                self.url = line.split("listening on ")[1].split()[0]
            if "ready:" in line:
                self.output_dir = Path(line.split("outputs in ")[1].split()[0].rstrip(";"))
                break
        assert self.url.startswith("http://127.0.0.1:"), self.log()
        return self

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def log(self) -> str:
        return f"--- stdout\n{''.join(self.stdout)}\n--- stderr\n{self.stderr_path.read_text()}"

    def pids(self, rank: int | None = None) -> list[int]:
        """The processes carrying this server's tag (the command, mpiexec, the ranks)."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                env = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"HSDP_SERVE_TEST_TAG={self.tag}".encode() not in env:
                continue
            if rank is None or f"OMPI_COMM_WORLD_RANK={rank}".encode() in env:
                found.append(int(entry.name))
        return found

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not exit within {timeout} s\n{self.log()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                for pid in self.pids():
                    os.kill(pid, signal.SIGKILL)
                self.proc.wait(30)
        shutil.rmtree(self.shm, ignore_errors=True)

    def control_file(self) -> Path:
        """The pid file the command made for rank 0 (a temporary file of the server's)."""
        (rank0,) = self.pids(rank=0)
        env = dict(e.split(b"=", 1) for e in Path(f"/proc/{rank0}/environ").read_bytes().split(b"\0") if b"=" in e)
        return Path(env[b"HSDP_SERVE_CONTROL"].decode())

    def left_behind(self, control: Path | None = None) -> list[str]:
        """Processes, shared-memory segments or temporary files of this server still there."""
        left = [f"process {pid}" for pid in self.pids()]
        if control is not None and control.exists():
            left.append(f"control file {control}")
        left += [f"/dev/shm segment {p.name}" for p in self.shm.iterdir()] if self.shm.exists() else []
        if self.output_dir is not None and self.output_dir.exists():
            left.append(f"output folder {self.output_dir}")
        return left


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serve-pipelines")
    return {kind: make_tiny_pipeline(root / kind, kind) for kind in ("wan22", "flux")}


@pytest.fixture(scope="module")
def image_server(folders, tmp_path_factory) -> Iterator[Server]:
    """The Flux server, started (not waited for) before the video server: it loads while the
    video tests run."""
    server = Server(folders["flux"], tmp_path_factory.mktemp("serve-image"), [])
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def video(folders, tmp_path_factory, image_server) -> Iterator[Server]:
    server = Server(folders["wan22"], tmp_path_factory.mktemp("serve-video"),
                    ["--api-key", KEY, "--cache", "none", "--cache", "first-block:0.2", "--omni", *LIMIT_FLAGS,
                     "--shutdown-grace", "100"],
                    {"HSDP_SERVE_FAULT_PROMPT": FAULTS})
    try:
        yield server.wait_ready()
    finally:
        server.close()


@pytest.fixture(scope="module")
def client(video) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=video.url, headers=AUTH, timeout=JOB_TIMEOUT) as c:
        yield c


def _form(**fields: str) -> dict[str, str]:
    return {**VIDEO, **fields}


def _sync(client: httpx.Client, **fields: str) -> bytes:
    r = client.post("/v1/videos/sync", data=_form(**fields))
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "video/mp4" and r.content[4:8] == b"ftyp"
    return r.content


def _until(what: str, check, limit: float = JOB_TIMEOUT, polls: int = 2000):  # type: ignore[no-untyped-def]
    """Polls ``check()`` until it returns a truthy value; bounded in count and time."""
    deadline = time.monotonic() + limit
    pause = threading.Event()
    for _ in range(polls):
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            break
        pause.wait(0.05)
    pytest.fail(f"{what}: not reached within {limit} s / {polls} polls")


# ------------------------------------------------------------------------- in process: the job store


def test_job_store_runs_in_arrival_order_and_loses_no_accepted_job():
    from hsdp.serve.jobs import JobStore, QueueFull, Stopping

    store = JobStore("m", max_queue=4)
    jobs = [store.submit({"kind": "video", "prompt": f"p{i}", "seed": i, "fps": 16}) for i in range(4)]
    with pytest.raises(QueueFull, match="4 jobs are waiting already"):
        store.submit({"kind": "video", "prompt": "one too many", "seed": 0, "fps": 16})
    assert store.queue_length() == 4 and [j.status for j in jobs] == ["queued"] * 4
    first = store.next(0)
    assert first is jobs[0] and first.status == "in_progress"
    assert store.delete(first.id) == (first, False) and first.cancel.is_set()  # running: asked to stop
    assert store.delete(jobs[1].id) == (jobs[1], True) and jobs[1].done.is_set() and store.get(jobs[1].id) is None
    store.finish(first, "stopped", cancelled=True)
    assert first.status == "cancelled" and first.public()["error"]["code"] == "cancelled" and first.done.is_set()
    assert store.next(0) is jobs[2]
    store.finish(jobs[2], "ValueError: bad")
    assert jobs[2].public()["error"] == {"code": "generation_failed", "message": "ValueError: bad"}
    store.stop_accepting()
    with pytest.raises(Stopping):
        store.submit({"kind": "video", "prompt": "late", "seed": 0, "fps": 16})
    assert store.next(0) is None  # stopping: nothing more starts
    assert store.fail_queued("stopped") == 1 and jobs[3].status == "failed" and jobs[3].done.is_set()
    assert [j.status for j in store.list()] == ["cancelled", "failed", "failed"]


def test_a_state_folder_keeps_finished_jobs_requeues_queued_and_fails_the_one_running(tmp_path):
    """What a restart finds (the server test below restarts a real server; this one also
    covers a server killed while a job ran)."""
    from hsdp.serve.jobs import JobStore
    from hsdp.serve.state import StateDir

    store = JobStore("m", state=StateDir(tmp_path))
    done, running, waiting, gone = (store.submit({"kind": "video", "prompt": f"p{i}", "seed": i, "fps": 16})
                                    for i in range(4))
    assert store.next(0) is done
    done.output = tmp_path / "outputs" / "x.mp4"
    done.stage_durations, done.peak_memory_mb = {"encode": 0.5}, {0: 10.0, 1: 12.5}
    done.compile = {"mode": "whole", "warm_up": True, "compile_seconds": 1.5}  # kept with the job
    store.finish(done, None)
    assert store.next(0) is running  # ... and the server is killed here
    assert store.delete(gone.id) == (gone, True)
    store.state.close()
    again = JobStore("m", state=StateDir(tmp_path))
    assert again.restore() == (1, 1, 1)
    by_id = {j.id: j for j in again.list()}
    assert set(by_id) == {done.id, running.id, waiting.id}
    assert by_id[done.id].public() == done.public() and by_id[done.id].output == done.output
    assert by_id[running.id].status == "failed" and "not run again" in by_id[running.id].error
    assert again.next(0).id == waiting.id  # the queued job runs


def test_finished_jobs_expire_after_the_ttl_with_their_files(tmp_path):
    from hsdp.serve.jobs import JobStore

    store = JobStore("m", ttl=60)
    old, new = (store.submit({"kind": "video", "prompt": p, "seed": 0, "fps": 16}) for p in ("old", "new"))
    for job in (store.next(0), store.next(0)):
        job.output = tmp_path / f"{job.id}.mp4"
        job.output.write_bytes(b"mp4")
        store.finish(job, None)
    old.completed_at -= 61
    assert store.expire() == 1 and [j.id for j in store.list()] == [new.id] and not old.output.exists() and new.output.exists()


def test_seconds_sizes_and_limits(folders):
    from hsdp.cli.folder import read_folder
    from hsdp.serve.params import Limits, RequestError, fill_defaults, folder_options, video_params

    wan = read_folder(folders["wan22"])
    p = video_params({"prompt": "a cat", "seconds": "1", "fps": "16"}, None, wan)
    assert p["num_frames"] == 17 and "16 frames, rounded to 17 (WanPipeline takes 4k+1" in p["frames_from_seconds"]["note"]
    assert video_params({"prompt": "a cat", "seconds": "0.5", "fps": "8"}, None, wan)["num_frames"] == 5
    limits = Limits(max_pixels=1024, max_frames=9, max_steps=4, max_prompt_chars=10)
    for fields, param, words in (({"size": "64x32"}, "size", "2048 pixels; this server takes at most 1024 (--max-pixels)"),
                                 ({"seconds": "1"}, "seconds", "num_frames 17 is over this server's limit of 9 (--max-frames)"),
                                 ({"num_inference_steps": "5"}, "num_inference_steps", "(--max-steps)"),
                                 ({"prompt": "x" * 11}, "prompt", "11 characters; this server takes at most 10"),
                                 ({"num_frames": "5", "seconds": "1"}, "seconds", "either seconds or num_frames"),
                                 ({"boundary_ratio": "1.5"}, "boundary_ratio", "must be <= 1"),
                                 ({"input_reference": "https://x/y.png"}, "input_reference", "not fetched")):
        with pytest.raises(RequestError, match=re.escape(words)) as err:
            video_params({"prompt": "a cat", **fields}, None, wan, limits=limits, options=folder_options(wan))
        assert err.value.param == param
    with pytest.raises(RequestError, match="flow_shift does not apply"):
        video_params({"prompt": "a cat", "flow_shift": "3"}, None, wan)  # no options: a folder without one
    assert folder_options(wan) == ("boundary_ratio", "guidance_scale_2", "flow_shift")
    ran = fill_defaults(video_params({"prompt": "a cat"}, None, wan, limits=limits),
                        {"width": 832, "height": 480, "num_frames": 81, "num_inference_steps": 50}, limits, wan)
    assert (ran["width"], ran["height"], ran["num_frames"], ran["num_inference_steps"]) == (32, 16, 9, 4)
    assert ran["defaulted"]["size"] == "the model's default 832x480 capped by --max-pixels 1024"
    i2v = read_folder(make_tiny_pipeline(folders["wan22"].parent / "i2v", "wan22-i2v"))
    png = io.BytesIO()
    __import__("PIL.Image").Image.new("RGB", (16, 16)).save(png, format="PNG")
    data = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    assert video_params({"prompt": "a cat", "input_reference": {"image_url": data}}, None, i2v)["image_b64"]


def test_cfg_parallel_servers_refuse_jobs_that_do_not_guide(folders):
    from hsdp.cli.folder import read_folder
    from hsdp.serve.params import RequestError, image_params, video_params

    wan, flux = read_folder(folders["wan22"]), read_folder(folders["flux"])
    assert video_params({"prompt": "a cat", "guidance_scale": "1"}, None, wan)["guidance_scale"] == 1.0
    with pytest.raises(RequestError, match="guidance_scale 1 turns it off") as err:
        video_params({"prompt": "a cat", "guidance_scale": "1"}, None, wan, cfg_parallel=True)
    assert err.value.param == "guidance_scale"
    assert video_params({"prompt": "a cat"}, None, wan, cfg_parallel=True)["guidance_scale"] is None
    with pytest.raises(RequestError, match="true_cfg_scale above 1 and a negative_prompt"):
        image_params({"prompt": "a car", "true_cfg_scale": 4}, flux, cfg_parallel=True)
    ok = image_params({"prompt": "a car", "true_cfg_scale": 4, "negative_prompt": "blurry"}, flux, cfg_parallel=True)
    assert ok["true_cfg_scale"] == 4.0 and ok["negative_prompt"] == "blurry"


def test_a_request_picks_its_step_cache_among_the_servers(folders):
    from hsdp.cli.folder import read_folder
    from hsdp.serve.params import RequestError, image_params, video_params

    wan, flux = read_folder(folders["wan22"]), read_folder(folders["flux"])
    allowed = ("first-block:0.2", "taylorseer")
    assert video_params({"prompt": "a cat"}, None, wan, caches=allowed)["cache"] == "first-block:0.2"  # the default
    assert video_params({"prompt": "a cat"}, None, wan, caches=("none", *allowed))["cache"] is None
    pick = video_params({"prompt": "a cat", "extra_params": '{"cache": "taylorseer"}'}, None, wan, caches=allowed)
    assert pick["cache"] == "taylorseer"
    assert video_params({"prompt": "a cat", "extra_params": '{"cache": "none"}'}, None, wan, caches=allowed)["cache"] is None
    assert image_params({"prompt": "a car", "extra_params": {"cache": "taylorseer"}}, flux, caches=allowed)["cache"] == "taylorseer"
    for extra, words in (('{"cache": "first-block:0.9"}', ("'first-block:0.9' is not one this server allows: "
                                                           "'first-block:0.2', 'taylorseer', 'none'")),
                         ('{"steps": 3}', "takes 'cache' only; unknown: 'steps'"),
                         ("[1]", "must be a JSON object, got list"), ("{", "must be a JSON object (")):
        with pytest.raises(RequestError, match=re.escape(words)) as err:
            video_params({"prompt": "a cat", "extra_params": extra}, None, wan, caches=allowed)
        assert err.value.param == "extra_params"
    with pytest.raises(RequestError, match="is not one this server allows: 'none'"):
        video_params({"prompt": "a cat", "extra_params": '{"cache": "taylorseer"}'}, None, wan)  # no --cache


@pytest.mark.parametrize("flags, words", [
    (["--model", "{tmp}/none"], "--model {tmp}/none: no such folder"),
    (["--model", "{wan}", "--port", "70000"], "--port must be in 0..65535, got 70000"),
    (["--model", "{wan}", "--api-key", " "], "--api-key is empty"),
    (["--model", "{wan}", "--max-queue", "0"], "--max-queue must be >= 1, got 0"),
    (["--model", "{wan}", "--ring-degree", "0"], "ring_degree must be a positive int, got 0"),
    (["--model", "{wan}", "--cache", "lru:3"], "the kind must be one of first-block, taylorseer, magcache"),
    (["--model", "{wan}", "--use-hsdp", "--hsdp-shard-size", "2", "--tensor-parallel-size", "2"],
     "use_hsdp=True cannot be combined with tensor parallel (tensor_parallel_size=2)"),
])
def test_bad_flags_exit_2_naming_the_flag(folders, tmp_path, capsys, flags, words):
    from hsdp.serve import cli

    fill = {"tmp": str(tmp_path), "wan": str(folders["wan22"])}
    assert cli.main([f.format(**fill) for f in flags]) == 2
    assert words.format(**fill) in capsys.readouterr().err


def test_a_port_in_use_is_refused_before_loading(folders):
    import socket

    from hsdp.serve import cli

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        try:
            with pytest.raises(RuntimeError, match=f"could not listen on 127.0.0.1:{port}"):
                cli.main(["--model", str(folders["wan22"]), "--port", str(port)])
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)


# ------------------------------------------------------------------------- the video server


def test_health_models_and_the_key(video, client):
    assert httpx.get(f"{video.url}/health").json() == {"status": "ok", "model": "wan22", "queue_length": 0}
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["wan22"] and models["data"][0]["pipeline"] == "WanPipeline"
    for method, path in (("GET", "/v1/models"), ("GET", "/v1/videos"), ("POST", "/v1/videos"),
                         ("POST", "/v1/videos/sync"), ("GET", "/v1/videos/video_x/content"),
                         ("DELETE", "/v1/videos/video_x"), ("POST", "/v1/images/generations")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, f"{video.url}{path}", headers=headers, data=_form(prompt="a cat"))
            assert r.status_code == 401, (method, path, headers, r.text)
            assert "Authorization: Bearer" in r.json()["error"]["message"]


def test_job_lifecycle_list_content_delete(client):
    r = client.post("/v1/videos", data=_form(prompt="a red car on the street", seed="3", fps="8"))
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["object"] == "video" and job["status"] in ("queued", "in_progress") and job["seed"] == 3
    assert job["size"] == "32x32" and job["num_frames"] == 5 and job["fps"] == 8
    # Jobs run in arrival order: once a later sync job is answered, the first one has ended.
    after = _sync(client, prompt="a dog", seed="4")
    done = client.get(f"/v1/videos/{job['id']}").json()
    assert done["status"] == "completed" and done["progress"] == 100 and done["error"] is None, done
    assert job["id"] in [j["id"] for j in client.get("/v1/videos").json()["data"]]
    content = client.get(f"/v1/videos/{job['id']}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    assert content.content[4:8] == b"ftyp" and content.content != after
    # The same request again, alone, gives the same bytes.
    assert _sync(client, prompt="a red car on the street", seed="3", fps="8") == content.content
    assert client.delete(f"/v1/videos/{job['id']}").json() == {"id": job["id"], "object": "video.deleted",
                                                               "deleted": True}
    for path in (f"/v1/videos/{job['id']}", f"/v1/videos/{job['id']}/content"):
        assert client.get(path).status_code == 404
    assert client.delete(f"/v1/videos/{job['id']}").status_code == 404


@pytest.mark.parametrize("fields, param, words", [
    ({"prompt": ""}, "prompt", "prompt is required"),
    ({"num_inference_steps": "-3"}, "num_inference_steps", "must be >= 1, got -3"),
    ({"num_inference_steps": "abc"}, "num_inference_steps", "must be an integer, got 'abc'"),
    ({"width": "40"}, "width", "width 40 is not a multiple of 16"),
    ({"width": "", "height": "", "size": "40x32"}, "size", "width 40 is not a multiple of 16"),
    ({"width": "", "height": "", "size": "big"}, "size", "'WIDTHxHEIGHT'"),
    ({"num_frames": "6"}, "num_frames", "num_frames - 1 to be a multiple of 4"),
    ({"guidance_scale": "nan"}, "guidance_scale", "positive finite number"),
    ({"seed": "1.5"}, "seed", "must be an integer"),
    ({"fps": "0"}, "fps", "must be >= 1"),
])
def test_bad_video_fields_get_400_naming_the_field(client, fields, param, words):
    form = {"prompt": "a cat", **VIDEO, **fields}
    r = client.post("/v1/videos", data={k: v for k, v in form.items() if v != "" or k == "prompt"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_other_bad_requests_and_the_server_stays_up(video, client):
    r = client.post("/v1/videos", data=_form(prompt="a cat"), files={"input_reference": ("f.png", b"x", "image/png")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference", r.text
    r = client.post("/v1/videos", data=_form(prompt="a cat", model="other"))
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    r = client.post("/v1/images/generations", json={"prompt": "a cat"})
    assert r.status_code == 404 and "POST /v1/videos" in r.json()["error"]["message"], r.text
    assert client.get("/v1/videos/nope").status_code == 404
    assert httpx.get(f"{video.url}/health").json()["status"] == "ok"


def test_a_job_with_a_step_cache_reports_its_skipped_forwards(client):
    """The server allows first-block:0.2 besides no cache (the default): a job asking for it
    runs with it and reports each expert's forwards; the next job runs without."""
    r = client.post("/v1/videos/sync", data=_form(prompt="a cat in the snow", seed="7", num_inference_steps="8",
                                                  extra_params='{"cache": "first-block:0.2"}'))
    assert r.status_code == 200, r.text
    job = client.get(f"/v1/videos/{r.headers['X-Video-Id']}").json()
    counts = job["cache"]["forwards"]
    assert job["cache"]["spec"] == "first-block:0.2" and set(counts) == {"transformer", "transformer_2"}, job
    assert sum(c["skipped"] for c in counts.values()) > 0 and sum(c["computed"] for c in counts.values()) > 0, job
    r = client.post("/v1/videos/sync", data=_form(prompt="a cat in the snow", seed="7"))
    assert "cache" not in client.get(f"/v1/videos/{r.headers['X-Video-Id']}").json()


def test_a_failure_inside_the_model_fails_its_job_and_the_next_job_runs(client):
    r = client.post("/v1/videos", data=_form(prompt=FAULT, seed="1"))
    failing = r.json()["id"]
    r = client.post("/v1/videos/sync", data=_form(prompt=FAULT, seed="2"))
    assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"], r.text
    job = client.get(f"/v1/videos/{failing}").json()
    assert job["status"] == "failed" and "injected fault" in job["error"]["message"], job
    assert client.get(f"/v1/videos/{failing}/content").status_code == 409
    assert _sync(client, prompt="a bird in the sky", seed="5")  # every rank moved on, in step


def test_eight_concurrent_clients_each_equal_to_the_request_alone(client):
    requests = [_form(prompt=p, seed=str(s)) for p, s in
                (("a cat in the snow", 11), ("a fish in the river", 12), ("a horse in the field", 13),
                 ("a cat in the snow", 14))]
    alone = [_sync(client, **r) for r in requests]
    assert len(set(alone)) == len(alone)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        loaded = list(pool.map(lambda i: _sync(client, **requests[i % 4]), range(8)))
    assert all(loaded[i] == alone[i % 4] for i in range(8)), "a result under load differs from the request alone"


def _error_shape(r: httpx.Response, status: int, words: str) -> dict:
    assert r.status_code == status, (status, r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, error
    assert words in error["message"], error
    return error


def test_every_error_has_openai_shape_and_the_right_status(video, client):
    _error_shape(client.get("/nope"), 404, "no route GET /nope")
    _error_shape(client.put("/v1/videos"), 405, "PUT is not allowed on /v1/videos")
    _error_shape(client.post("/v1/videos", content=b"prompt=x", headers={"Content-Type": "text/plain"}), 415,
                 "Content-Type 'text/plain' is not read here")
    _error_shape(client.post("/v1/images/generations", data={"prompt": "x"}), 415, "send application/json")
    # a 10 MB prompt in a multipart form: refused while it is read
    _error_shape(client.post("/v1/videos", files={"prompt": (None, "x" * (10 << 20))}), 413, "maximum size")
    # a body announced larger than the server reads: refused before it is read
    import socket

    with socket.create_connection(("127.0.0.1", int(video.url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000000000\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n{")
        sock.settimeout(JOB_TIMEOUT)
        head = b""
        for _ in range(100):  # the head and the body may come in separate segments
            if b"at most" in head or not (part := sock.recv(65536)):
                break
            head += part
    assert head.startswith(b"HTTP/1.1 413") and b"at most" in head, head
    error = _error_shape(client.post("/v1/videos", data=_form(prompt="x" * 2001)), 400, "(--max-prompt-chars)")
    assert error["param"] == "prompt"
    _error_shape(client.post("/v1/videos", data=_form(prompt="a cat", size="64x32", width="", height="")), 400,
                 "(--max-pixels)")
    _error_shape(client.post("/v1/videos", json=[1]), 400, "must be a JSON object")
    # a JSON body; a prompt at the limit, whole in the job, cut in the listing
    long = "a cat " * 333
    r = client.post("/v1/videos", json={"prompt": long, "size": "32x32", "num_frames": 5, "num_inference_steps": 2,
                                        "seed": 3, "negative_prompt": "blurry"})
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["prompt"] == long and job["negative_prompt"] == "blurry" and job["size"] == "32x32", job
    listed = [j for j in client.get("/v1/videos").json()["data"] if j["id"] == job["id"]]
    assert listed[0]["prompt"].startswith(long[:200]) and len(listed[0]["prompt"]) < 250, listed
    assert httpx.get(f"{video.url}/health").json()["status"] == "ok"


# The SDK warns that OpenAI's own video API will close; the calls are what this server serves.
SDK_WARNING = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


def _openai(url: str):  # type: ignore[no-untyped-def]
    openai = pytest.importorskip("openai")
    return openai.OpenAI(api_key=KEY, base_url=f"{url}/v1", timeout=JOB_TIMEOUT, max_retries=0)


@SDK_WARNING
def test_openai_client_videos_create_with_seconds(video):
    sdk = _openai(video.url)
    v = sdk.videos.create(model="wan22", prompt="a boat at sea", seconds="1", size="32x32",
                          extra_body={"num_inference_steps": 2, "fps": 4, "seed": 9})
    assert v.status in ("queued", "in_progress") and v.size == "32x32"
    done = _until("the SDK's job completed", lambda: (j := sdk.videos.retrieve(v.id)).status == "completed" and j)
    job = done.model_dump()
    assert job["num_frames"] == 5 and job["seconds"] == "1.25", job  # 1 s x 4 fps = 4 frames, rounded to 4k+1
    assert job["frames_from_seconds"] == "1 s x 4 fps = 4 frames, rounded to 5 (WanPipeline takes 4k+1 frames)"
    assert set(job["stage_durations"]) == {"encode", "denoise", "decode", "write"}, job
    assert job["inference_time_s"] > 0 and set(job["peak_memory_mb_per_rank"]) == {"0", "1"}, job
    assert job["peak_memory_mb"] > 0
    assert sdk.videos.download_content(v.id).content[4:8] == b"ftyp"


def _doc_client_blocks() -> list[str]:
    """The ```python blocks of docs/serving.md's "Examples: Python clients" section."""
    text = (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
    section = text.split("## Examples: Python clients", 1)[1].split("\n## ", 1)[0]
    return [part.split("```", 1)[0] for part in section.split("```python\n")[1:]]


@SDK_WARNING
def test_the_docs_python_client_examples_run_against_the_tiny_servers(video, image, tmp_path, monkeypatch):
    """docs/serving.md's SDK and httpx examples, as written, but for the address, the key and
    the model id of these servers (the docs start theirs on port 8091, served as tiny-wan22 /
    tiny-flux): each runs, and writes what it says it writes."""
    pytest.importorskip("openai")
    images, videos, plain = _doc_client_blocks()
    monkeypatch.chdir(tmp_path)
    for code, server, model, wrote, at, magic in ((images, image, "flux", "car.png", 0, b"\x89PNG"),
                                                  (videos, video, "wan22", "cat.mp4", 4, b"ftyp"),
                                                  (plain, video, None, "cat.mp4", 4, b"ftyp")):
        assert "http://localhost:8091" in code, code
        code = code.replace("http://localhost:8091", server.url).replace('"KEY"', f'"{KEY}"')
        code = code.replace("Bearer KEY", f"Bearer {KEY}")
        code = re.sub(r'model="tiny-(wan22|flux)"', f'model="{model}"', code)
        assert "KEY" not in code.replace(KEY, "") and 'model="tiny-' not in code, code
        (tmp_path / wrote).unlink(missing_ok=True)
        exec(compile(code, "docs/serving.md", "exec"), {"__name__": "__main__"})  # noqa: S102 - the docs' own code
        assert (tmp_path / wrote).read_bytes()[at:at + 4] == magic, (wrote, code)


def test_cancel_a_running_default_sized_job_within_one_step_and_the_next_runs(client):
    """A request without sizes: the model's defaults (832x480, 81 frames, 50 steps) capped by
    the server's limits (--max-pixels 1024, --max-frames 9); cancelled while it runs."""
    job = client.post("/v1/videos", data={"prompt": "a default-sized cat", "num_inference_steps": "100"}).json()
    running = _until("the job at its third step", lambda: (j := client.get(f"/v1/videos/{job['id']}").json())
                     ["progress"] >= 2 and j)
    assert running["size"] == "32x16" and running["num_frames"] == 9, running
    assert running["defaulted"]["size"] == "the model's default 832x480 capped by --max-pixels 1024", running
    asked = time.monotonic()
    r = client.delete(f"/v1/videos/{job['id']}")
    assert r.status_code == 202 and r.json()["status"] == "cancelling", r.text
    ended = _until("the job cancelled", lambda: (j := client.get(f"/v1/videos/{job['id']}").json())["status"]
                   != "in_progress" and j, polls=100000)
    took = time.monotonic() - asked
    step = ended["stage_durations"]["denoise"] / ended["steps_done"]  # a step's seconds, on average
    assert ended["status"] == "cancelled" and ended["error"]["code"] == "cancelled", ended
    assert "cancelled while it ran (DELETE), at the end of step" in ended["error"]["message"], ended
    assert took < step + 1.0 and ended["steps_done"] < 50, (took, step, ended)
    assert _sync(client, prompt="after the cancel", seed="5")  # every rank moved on, in step
    assert client.delete(f"/v1/videos/{job['id']}").json()["deleted"] is True  # ended: now it can go


def test_a_failure_on_rank_1_alone_fails_the_job_naming_the_rank_and_the_next_runs(client):
    r = client.post("/v1/videos/sync", data=_form(prompt=FAULT_RANK1, seed="2"))
    assert r.status_code == 500, r.text
    assert "rank 1: InjectedFault: injected fault" in r.json()["error"]["message"], r.text
    job = client.get(f"/v1/videos/{r.json()['error']['message'].split()[1]}").json()
    assert job["status"] == "failed" and job["error"]["message"].startswith("rank 1: "), job
    assert _sync(client, prompt="a bird in the sky", seed="6")


def test_metrics_in_prometheus_text(video, client):
    from prometheus_client.parser import text_string_to_metric_families

    assert httpx.get(f"{video.url}/metrics").status_code == 401  # guarded by the key like the API
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(r.text) for s in family.samples}
    assert samples[("hsdp_serve_queue_depth", ())] >= 0
    for status in ("completed", "failed", "cancelled"):  # the tests above ended jobs each way
        assert samples[("hsdp_serve_jobs_total", (("status", status),))] >= 1, status
    assert samples[("hsdp_serve_step_latency_seconds_count", ())] >= 2
    assert samples[("hsdp_serve_job_latency_seconds_count", ())] >= 3
    assert all(samples[("hsdp_serve_peak_memory_mb", (("rank", r),))] > 0 for r in ("0", "1"))


def test_sigterm_lets_the_running_job_end_fails_the_queued_and_leaves_nothing(video, client):
    results: dict[str, httpx.Response] = {}

    def post(name: str, steps: str) -> None:
        with httpx.Client(base_url=video.url, headers=AUTH, timeout=JOB_TIMEOUT) as c:
            results[name] = c.post("/v1/videos/sync", data=_form(prompt=f"a {name}", num_inference_steps=steps))

    running = threading.Thread(target=post, args=("tree", "90"))  # long enough to outlast the checks below under load
    running.start()
    (job,) = _until("the job in progress", lambda: [j for j in client.get("/v1/videos").json()["data"]
                                                   if j["prompt"] == "a tree" and j["status"] == "in_progress"])
    assert 0 <= job["progress"] <= 99 and job["started_at"] is not None, job
    queued = threading.Thread(target=post, args=("house", "2"))
    queued.start()
    _until("the second job queued", lambda: client.get("/health").json()["queue_length"] == 2)
    video.proc.send_signal(signal.SIGTERM)
    # Until the running job ends: no new job (503), status still answered.
    _until("health says stopping", lambda: client.get("/health").json()["status"] == "stopping")
    r = client.post("/v1/videos", data=_form(prompt="a late cat"))
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
    assert client.get(f"/v1/videos/{job['id']}").json()["status"] in ("in_progress", "completed")
    assert video.wait(120) == 0, video.log()
    running.join(JOB_TIMEOUT)
    queued.join(JOB_TIMEOUT)
    assert results["tree"].status_code == 200 and results["tree"].content[4:8] == b"ftyp", results["tree"].text
    assert results["house"].status_code == 500, results["house"].text
    assert "stopped before this job ran" in results["house"].json()["error"]["message"]
    assert "stopped after" in "".join(video.stdout)
    assert "--omni is accepted for vllm-omni's command lines and ignored" in "".join(video.stdout)
    with pytest.raises(httpx.ConnectError):
        client.get("/health")
    assert video.left_behind() == [], video.log()


# ------------------------------------------------------------------------- the image server


@pytest.fixture(scope="module")
def image(image_server) -> Server:
    return image_server.wait_ready()


def test_images_generations_then_a_killed_rank_ends_the_server(image):
    import numpy as np
    from PIL import Image

    with httpx.Client(base_url=image.url, timeout=JOB_TIMEOUT) as c:
        body = {"prompt": "a red car", "size": "32x32", "n": 2, "seed": 7, "num_inference_steps": 2,
                "response_format": "b64_json"}
        r = c.post("/v1/images/generations", json=body)
        assert r.status_code == 200, r.text
        pngs = [base64.b64decode(d["b64_json"]) for d in r.json()["data"]]
        assert len(pngs) == 2 and all(p[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
        assert np.asarray(Image.open(io.BytesIO(pngs[0]))).shape == (32, 32, 3)
        assert [base64.b64decode(d["b64_json"]) for d in c.post("/v1/images/generations", json=body).json()["data"]] == pngs
        for bad, param in (({"size": "33x32"}, "size"), ({"n": 0}, "n"), ({"response_format": "url"}, "response_format"),
                           ({"prompt": None}, "prompt"), ({"num_inference_steps": "x"}, "num_inference_steps")):
            r = c.post("/v1/images/generations", json={**body, **bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = c.post("/v1/images/generations", content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert c.post("/v1/videos", data=_form(prompt="a cat")).status_code == 404
    sdk = _openai(image.url)
    result = sdk.images.generate(model="flux", prompt="a red car", size="32x32", response_format="b64_json",
                                 extra_body={"seed": 7, "num_inference_steps": 2, "n": 2})
    assert [base64.b64decode(d.b64_json) for d in result.data] == pngs  # the same call as above
    # A rank that dies takes the server down with a message, never a hang; the command then
    # removes the temporary output folder the rank could not.
    (rank1,) = image.pids(rank=1)
    os.kill(rank1, signal.SIGKILL)
    assert image.wait(120) != 0
    text = image.log()
    assert "signal 9" in text or "Killed" in text, text
    _until("every process gone", lambda: not image.pids(), limit=30, polls=600)
    assert image.output_dir is not None and not image.output_dir.exists(), image.output_dir
