"""Stopping ``hsdp serve`` (2 ranks, a tiny Wan2.2 folder) each way that test_serve.py does not,
and a restart on its ``--state-dir``:

- a second SIGTERM ends the server at once, its running job unfinished (it would otherwise have
  had ``--shutdown-grace`` 100 s);
- the restart on the same ``--state-dir``: the completed job listed and its video
  byte-identical, the queued job run, the job that was running at the kill marked failed;
- SIGTERM with ``--shutdown-grace 1``: the running job is cancelled once the grace has passed,
  and the queued one stays queued in the state folder for the next start;
- without the ``[serve]`` extra: one line naming ``pip install 'hsdp[serve]'``.

Each server runs with a temporary folder of its own (``TMPDIR``: where the command makes its
pid file and, without ``--state-dir``, the output folder, and Open MPI its session folder);
after each stop it must be empty, and no process of the server left."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hsdp.testing.tiny_pipeline import make_tiny_pipeline
from test_serve import JOB_TIMEOUT, ROOT, Server, _form, _until, httpx

LONG = "400"  # steps of a job that is still running when the server is stopped


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_pipeline(tmp_path_factory.mktemp("serve-stop") / "wan22", "wan22")


def _server(folder: Path, root: Path, name: str, extra: list[str]) -> tuple[Server, Path]:
    """A server whose temporary files all go to a folder of its own (returned)."""
    tmp = root / f"{name}-tmp"
    tmp.mkdir()
    return Server(folder, root, extra, {"TMPDIR": str(tmp)}), tmp


def _running(client: httpx.Client, prompt: str) -> dict[str, Any]:
    """Submits a long job and waits until it runs its steps."""
    job = client.post("/v1/videos", data=_form(prompt=prompt, num_inference_steps=LONG)).json()
    return _until(f"{prompt!r} running", lambda: (j := client.get(f"/v1/videos/{job['id']}").json())
                  ["steps_done"] >= 1 and j)


def _leftovers(server: Server, tmp: Path) -> list[str]:
    left = [f"process {pid}" for pid in server.pids()]
    return left + [f"temporary file {p}" for p in tmp.rglob("*")]


@pytest.fixture(scope="module")
def killed(folder, tmp_path_factory) -> dict[str, Any]:
    """The first server, on a state folder: a completed job, a running one and a queued one when
    it gets SIGTERM twice. What the tests below check, measured here."""
    root = tmp_path_factory.mktemp("serve-stop-first")
    server, tmp = _server(folder, root, "first", ["--state-dir", str(root / "state"), "--shutdown-grace", "100"])
    try:
        server.wait_ready()
        with httpx.Client(base_url=server.url, timeout=JOB_TIMEOUT) as client:
            r = client.post("/v1/videos/sync", data=_form(prompt="a kept cat", seed="5"))
            assert r.status_code == 200, r.text
            done = {"id": r.headers["X-Video-Id"], "video": r.content}
            running = _running(client, "a cat running at the kill")
            queued = client.post("/v1/videos", data=_form(prompt="a queued cat", seed="6")).json()
            assert client.get(f"/v1/videos/{queued['id']}").json()["status"] == "queued"
            control = server.control_file()
            server.proc.send_signal(signal.SIGTERM)
            _until("health says stopping", lambda: client.get("/health").json()["status"] == "stopping")
            server.proc.send_signal(signal.SIGTERM)
            asked = time.monotonic()
            code = server.wait(60)
            took = time.monotonic() - asked
        _until("every process gone", lambda: not server.pids(), limit=30, polls=600)
        return {"state": root / "state", "done": done, "running": running, "queued": queued, "code": code,
                "took": took, "left": _leftovers(server, tmp) + ([f"pid file {control}"] if control.exists() else []),
                "log": server.log()}
    finally:
        server.close()


@pytest.fixture(scope="module")
def restarted(folder, killed, tmp_path_factory) -> Iterator[tuple[Server, Path]]:
    root = tmp_path_factory.mktemp("serve-stop-again")
    server, tmp = _server(folder, root, "again", ["--state-dir", str(killed["state"]), "--shutdown-grace", "1"])
    try:
        yield server.wait_ready(), tmp
    finally:
        server.close()


def test_a_second_sigterm_ends_the_server_at_once_and_leaves_nothing(killed):
    # The first SIGTERM gave the running job 100 s to end; the second ended the server at once
    # (not 0: the ranks were ended). The restart below finds that job unfinished.
    assert killed["code"] != 0 and killed["took"] < 30, (killed["code"], killed["took"], killed["log"])
    assert killed["left"] == [], (killed["left"], killed["log"])


def test_a_restart_on_the_state_dir_keeps_the_completed_runs_the_queued_fails_the_running(killed, restarted):
    server, _ = restarted
    # The second SIGTERM reaches every rank through mpiexec; rank 0 usually ends first and the
    # restart finds the job still running (marked failed now), but under load a follower can be
    # killed while rank 0 waits in the step's collective, and rank 0 records the failure itself
    # before it ends (seen once in a loaded full suite). Either way the job is failed, not run
    # again; test_serve's state-folder test pins the restart's own marking.
    stopped_there = "2 finished job(s) kept, 1 queued job(s) to run, 0 that was running marked failed"
    marked_here = "1 finished job(s) kept, 1 queued job(s) to run, 1 that was running marked failed"
    assert marked_here in server.log() or stopped_there in server.log(), (server.log(), killed["log"])
    with httpx.Client(base_url=server.url, timeout=JOB_TIMEOUT) as client:
        done = client.get(f"/v1/videos/{killed['done']['id']}").json()
        assert done["status"] == "completed" and done["prompt"] == "a kept cat", done
        content = client.get(f"/v1/videos/{killed['done']['id']}/content")
        assert content.status_code == 200 and content.content == killed["done"]["video"]
        was_running = client.get(f"/v1/videos/{killed['running']['id']}").json()
        assert was_running["status"] == "failed", was_running
        if marked_here in server.log():
            assert "the server stopped while this job ran; it is not run again" in was_running["error"]["message"]
        else:  # rank 0's own record of the failure, whatever the collective said
            assert was_running["error"]["message"], (was_running, killed["log"])
        queued = _until("the queued job completed", lambda: (j := client.get(
            f"/v1/videos/{killed['queued']['id']}").json())["status"] not in ("queued", "in_progress") and j)
        assert queued["status"] == "completed", queued
        video = client.get(f"/v1/videos/{killed['queued']['id']}/content").content
        assert video[4:8] == b"ftyp" and video != killed["done"]["video"]
        listed = [j["id"] for j in client.get("/v1/videos").json()["data"]]
        assert listed == [killed["done"]["id"], killed["running"]["id"], killed["queued"]["id"]], listed


def test_sigterm_cancels_the_running_job_once_the_grace_has_passed_and_keeps_the_queued(killed, restarted):
    server, tmp = restarted
    with httpx.Client(base_url=server.url, timeout=JOB_TIMEOUT) as client:
        running = _running(client, "a cat past the grace")
        queued = client.post("/v1/videos", data=_form(prompt="a cat for the next start")).json()
        control = server.control_file()
        sent = time.time()
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0, server.log()
    assert "--shutdown-grace) to end, then is cancelled" in server.log()
    db = sqlite3.connect(killed["state"] / "jobs.sqlite")
    rows = {jid: (status, error, completed) for jid, status, error, completed in
            db.execute("SELECT id, status, error, completed_at FROM jobs")}
    db.close()
    status, error, completed = rows[running["id"]]
    assert status == "cancelled" and "cancelled: the server stopped (--shutdown-grace 1 s passed)" in error, error
    assert completed >= sent + 1.0, (completed - sent)  # not before the grace
    assert rows[queued["id"]][0] == "queued"  # for the next start
    _until("every process gone", lambda: not server.pids(), limit=30, polls=600)
    assert _leftovers(server, tmp) == [] and not control.exists(), server.log()
    assert not list(server.shm.iterdir()), server.log()  # a clean stop leaves no shared memory either


def test_without_the_serve_extra_one_line_and_nothing_left(folder, tmp_path):
    """fastapi unimportable (as if never installed): the command says how to install the extra,
    in one line, before any rank starts or any temporary file is made."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    code = ("import runpy, sys; sys.modules['fastapi'] = None; sys.argv = ['hsdp', 'serve', sys.argv[1], "
            "'--use-hsdp', '--hsdp-shard-size', '2']; runpy.run_module('hsdp', run_name='__main__')")
    env = {**os.environ, "TMPDIR": str(tmp),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "python"), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code, str(folder)], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    line = "hsdp serve: error: the HTTP server needs the [serve] extra: pip install 'hsdp[serve]' (missing: fastapi)"
    assert proc.stderr.splitlines() == [line], proc.stderr
    assert proc.stdout == "" and list(tmp.iterdir()) == []
