"""``hsdp serve --data-parallel-size 2`` on 2 ranks: two jobs run at once, one per lane, the lanes
gathering in lockstep; a job that fails inside the model (the fault injection) fails alone while
the other lane's job completes, equal to its request run alone."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import pytest

# test_serve's own checks skip this module too where a server cannot run (no diffusers, httpx, ...)
from test_serve import AUTH, FAULT, JOB_TIMEOUT, KEY, Server, _form, _sync, httpx  # noqa: E402

from hsdp.testing.tiny_pipeline import make_tiny_pipeline  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder: Path = make_tiny_pipeline(tmp_path_factory.mktemp("serve-dp") / "wan22", "wan22")
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
