"""Ulysses sequence parallel and CFG parallel (hsdp.parallel): the exchanges on real ranks,
and the refusals. The example's combined modes end to end are in test_launch.py."""

from __future__ import annotations

import numpy as np
import pytest

from mpirun import run_ranks

from hsdp import models, parallel
from hsdp.engine.config import DiffusionParallelConfig
from hsdp.world.distributed import init_process_group


@pytest.mark.parametrize("sp,cfg", [(2, 1), (1, 2), (2, 2), (4, 1)])
def test_ulysses_and_cfg_exchanges_match_the_whole_computation(sp, cfg):
    n = sp * cfg
    out = run_ranks(n, "tests/parallel_worker.py", str(sp), str(cfg)).stdout
    assert out.count("parallel ok") == n, out


def test_a_world_of_one_has_no_groups_and_refuses_other_models():
    world = init_process_group("single")
    groups = parallel.init_parallel_groups(DiffusionParallelConfig(), world)
    assert groups.sp is None and groups.cfg is None and not groups.combined
    with pytest.raises(TypeError, match="reference hsdp.models.VideoDiT"):
        parallel.apply_sequence_parallel(object(), None)
    model = models.make_model("tiny")
    assert parallel.apply_sequence_parallel(model, None) is model


def test_grouped_buffers_are_reused_only_once_no_view_is_alive():
    sp = parallel.Ulysses(init_process_group("single"))
    a = sp.grouped(1, 4, 2, 3, np.float32)
    b = sp.grouped(1, 4, 2, 3, np.float32)  # a is alive: another buffer
    assert not np.shares_memory(a, b)
    where = a.__array_interface__["data"][0]
    del a
    c = sp.grouped(1, 4, 2, 3, np.float32)  # a's buffer is free again
    assert c.__array_interface__["data"][0] == where and not np.shares_memory(b, c)
    assert sp.grouped(1, 4, 2, 3, np.float64).dtype == np.float64


def test_a_mismatched_world_is_refused():
    world = init_process_group("single")
    with pytest.raises(ValueError, match="needs 2 ranks"):
        parallel.init_parallel_groups(DiffusionParallelConfig(ring_degree=2, use_hsdp=True), world)
    with pytest.raises(ValueError, match="needs 2 ranks"):
        parallel.init_parallel_groups(DiffusionParallelConfig(ulysses_degree=2, use_hsdp=True), world)
