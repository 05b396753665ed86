"""Ulysses for diffusers' Wan (hsdp.parallel_torch) on real ranks, with hsdp sharding the
weights over the same ranks, and its refusals."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")  # torch is an optional dependency; make test installs it

from mpirun import run_ranks  # noqa: E402
from torch_models import make_flux, make_wan  # noqa: E402

from hsdp import parallel  # noqa: E402
from hsdp.world.distributed import init_process_group  # noqa: E402
from hsdp.parallel.ulysses_wan import apply_sequence_parallel_torch  # noqa: E402


def test_wan_with_ulysses_and_hsdp_matches_the_unsharded_model():
    out = run_ranks(2, "tests/parallel_torch_worker.py", "float32", "bfloat16").stdout
    for dtype in ("float32", "bfloat16"):
        assert out.count(f"torch ulysses {dtype} ok on mpi") == 2, out


def test_only_wan_models_and_divisible_heads_are_taken():
    world = init_process_group("single")
    sp = parallel.Ulysses(world)
    with pytest.raises(TypeError, match="WanTransformer3DModel"):
        apply_sequence_parallel_torch(make_flux(0), sp)

    class Three:
        size, rank = 3, 0

    with pytest.raises(ValueError, match="num_heads=2 is not divisible by ulysses_degree=3"):
        apply_sequence_parallel_torch(make_wan(0), parallel.Ulysses(Three()))
