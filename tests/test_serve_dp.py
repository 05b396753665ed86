"""``hsdp serve --data-parallel-size 2`` on 2 ranks: two jobs run at once, one per lane, the lanes
gathering in lockstep; a job that fails inside the model (the fault injection) fails alone while
the other lane's job completes, equal to its request run alone. And the engine on 4 ranks, lanes
of 2: a failure on a lane's second rank alone names that rank and its own error."""

from __future__ import annotations

import concurrent.futures
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from mpirun import run_ranks

# test_serve's own checks skip this module too where a server cannot run (no diffusers, httpx, ...)
from test_serve import AUTH, FAULT, JOB_TIMEOUT, KEY, Server, _form, _sync, _until, httpx  # noqa: E402

from hsdp.testing.tiny_pipeline import make_tiny_pipeline  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_pipeline(tmp_path_factory.mktemp("serve-dp") / "wan22", "wan22")


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(folder, tmp_path_factory.mktemp("serve-dp-run"), ["--api-key", KEY, "--dp", "2"],
               {"HSDP_SERVE_FAULT_PROMPT": FAULT})
    try:
        yield s.wait_ready()
    finally:
        s.close()


def test_two_lanes_run_jobs_at_once_and_a_failing_job_fails_alone(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=JOB_TIMEOUT) as client:
        requests = [_form(prompt=p, seed=str(s)) for p, s in
                    (("a cat in the snow", 11), ("a fish in the river", 12), ("a horse in the field", 13))]
        alone = [_sync(client, **r) for r in requests]  # one at a time: lane 0 computes, lane 1 serves
        assert len(set(alone)) == len(alone)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # rounds of 2 jobs, one per lane
            loaded = list(pool.map(lambda i: _sync(client, **requests[i % 3]), range(6)))
        assert all(loaded[i] == alone[i % 3] for i in range(6)), "a job run beside another differs from it alone"

        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # a failing job beside a good one
            bad = pool.submit(lambda: client.post("/v1/videos/sync", data=_form(prompt=FAULT, seed="1")))
            good = pool.submit(lambda: _sync(client, **requests[0]))
            r = bad.result()
            assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"], r.text
            assert good.result() == alone[0]
        assert _sync(client, **requests[1]) == alone[1]  # every rank moved on, in step
    log = server.log()
    assert "2 lanes of 1 rank" in log and "(a round of 2)" in log, log  # two jobs did run at once


def test_a_cancel_stops_its_lane_alone(server):
    """Two jobs in one round (lane 0 and lane 1); DELETE on lane 1's job stops it at its next
    step (rank 1 hears it over the cancel channel) while lane 0's job runs on to the end."""
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=JOB_TIMEOUT) as client:
        first, second = (client.post("/v1/videos", data=_form(prompt=p, num_inference_steps="40")).json()
                         for p in ("a kept cat", "a cancelled cat"))
        _until("both jobs running", lambda: all(client.get(f"/v1/videos/{j['id']}").json()["status"] == "in_progress"
                                                for j in (first, second)))
        assert client.delete(f"/v1/videos/{second['id']}").status_code == 202
        ended = _until("both jobs ended", lambda: [j for j in (client.get(f"/v1/videos/{k['id']}").json()
                                                                for k in (first, second)) if j["status"] != "in_progress"]
                       if all(client.get(f"/v1/videos/{k['id']}").json()["status"] != "in_progress"
                              for k in (first, second)) else None)
        kept, cancelled = ended
        assert kept["status"] == "completed" and kept["steps_done"] == 40, kept
        assert cancelled["status"] == "cancelled" and "cancelled while it ran" in cancelled["error"]["message"], cancelled
        assert _sync(client, prompt="after", seed="3")  # both lanes moved on


def test_sigint_ends_the_server_at_once_and_leaves_nothing(server):
    control = server.control_file()
    server.proc.send_signal(signal.SIGINT)
    server.wait(60)
    left = [x for x in server.left_behind(control) if "/dev/shm" not in x]  # a killed rank may leave its segment
    assert left == [], server.log()


def test_a_failure_on_a_lanes_second_rank_names_that_rank_and_the_next_round_runs(folder, tmp_path):
    """D=2 x Ulysses 2 on 4 ranks (tests/serve_lane_worker.py): each lane's job raises on the
    lane's second rank alone (1, 3); its leader (0, 2) stops through the lane's step vote. Each
    job ends failed with the failing rank's own error, not its leader's "a peer failed"; the
    next round's two jobs complete."""
    faults = "lane 0 fails on rank 1@1|lane 1 fails on rank 3@3"
    out = run_ranks(4, "tests/serve_lane_worker.py", str(folder), str(tmp_path), timeout=600,
                    env={"HSDP_SERVE_FAULT_PROMPT": faults}).stdout
    for prompt, rank in (("lane 0 fails on rank 1", 1), ("lane 1 fails on rank 3", 3)):
        assert f"job {prompt!r}: failed: rank {rank}: InjectedFault: injected fault" in out, out
    assert "job 'a cat in the snow': completed: None" in out and "job 'a boat on a lake': completed: None" in out, out
    assert "PeerFailed" not in out and "ran 4" in out, out
