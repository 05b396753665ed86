"""Data parallel under HSDP (DiffusionParallelConfig(data_parallel_size=D)): each lane runs its own
outputs of a batch, the weights sharded over every lane, the lanes gathering in lockstep
(hsdp.engine.lockstep); every output equals the stock pipeline called with it alone."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from mpirun import run_ranks  # noqa: E402

from hsdp.testing.tiny_pipeline import make_tiny_pipeline  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dp")
    return {kind: make_tiny_pipeline(root / kind, kind, seed=0) for kind in ("wan22", "flux", "wan22-i2v")}


def test_two_lanes_every_output_equals_the_stock_pipeline_alone(folders):
    """D=2 on 2 ranks: Wan 2.2 (two experts) with 2 and 3 prompts, Flux with 2; lanes in one round
    with 4 and 6 steps (the experts switch at different steps), guidance on and off, and a
    third output on one lane while the other serves; two outputs per prompt; image to video
    with one image per prompt; refusals of bad batches on every rank.

    Then, in the same launch (a launch of its own would cost its start), every gather
    collective (collective:CASE: HSDP_DIRECT_GATHER=0, as on NCCL, or across hosts): the uneven
    round still equals the stock pipeline, the lanes serving each other's gathers; without the
    lockstep (the control) the lanes part ways and every rank raises, naming the units."""
    cases = ["wan22-dp2", "wan22-dp2-3prompts", "flux-dp2", "wan22-uneven", "wan22-per-prompt", "wan22-i2v-dp2",
             "refusals", "collective:wan22-uneven", "collective:wan22-uneven-no-lockstep"]
    out = run_ranks(2, "tests/dp_worker.py", str(folders["wan22"]), str(folders["flux"]), *cases, timeout=600,
                    env={"DP_I2V_DIR": str(folders["wan22-i2v"])}).stdout
    for case in cases[:6]:
        assert out.count(f": {case} ok") == 2, out
    assert out.count("refusals ok") == 2, out
    # the uneven round made the lanes serve each other's models
    served = [line for line in out.splitlines() if ": wan22-uneven ok" in line]
    assert len(served) == 2 and any("'served_forwards': 0" not in line for line in served), served

    assert out.count(": collective:wan22-uneven ok") == 2, out
    assert out.count(": collective:wan22-uneven-no-lockstep ok (desync caught)") == 2, out
    served = [line for line in out.splitlines() if ": collective:wan22-uneven ok" in line]
    assert any("'served_gathers': 0" not in line for line in served), served


def test_four_ranks_lanes_of_cfg_and_ulysses_pairs(folders):
    """D=2 x CFG 2 and D=2 x Ulysses 2 on 4 ranks: lanes of 2 ranks each; D=4 with 2 replica
    groups (S=2): each shard group's 2 lanes gather in lockstep, the groups independently (3
    prompts: one group's second lane has none); D=2 x Ulysses 2 with each lane's VAE tiles over
    its own 2 ranks."""
    cases = ["wan22-dp2-cfg2", "wan22-dp2-ulysses2", "wan22-dp4-r2", "wan22-dp2-ulysses2-vae2"]
    out = run_ranks(4, "tests/dp_worker.py", str(folders["wan22"]), str(folders["flux"]), *cases, timeout=600).stdout
    for case in cases:
        assert out.count(f": {case} ok") == 4, out
