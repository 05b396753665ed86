"""Ring attention and USP (hsdp.ring): the point-to-point slot, ring attention, and the
reference model against the unsharded computation, on real ranks (one 2-rank and one 4-rank
launch, each running every layout it allows; the 4-rank one runs the diffusers Wan
transformer too); the merge on one rank."""

from __future__ import annotations

import numpy as np
import pytest

from mpirun import run_ranks

from hsdp.parallel import ring
from hsdp.world.distributed import init_process_group
from hsdp.nn import functional as F


@pytest.mark.parametrize("n", [2, 4])
def test_ring_and_usp_layouts_match_the_whole_computation(n):
    out = run_ranks(n, "tests/ring_worker.py", *(["torch"] if n == 4 else [])).stdout
    assert out.count("ring ok") == n * (1 if n == 2 else 3), out


def test_the_lse_merge_is_exact_attention_over_the_union_of_blocks():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 5, 4)).astype(np.float32) for _ in range(3))
    k[..., :2, :] *= 30  # large scores: the merge must not overflow
    out = lse = None
    for lo, hi in ((0, 2), (2, 3), (3, 5)):
        out, lse = ring.merge(out, lse, *ring.block_attention(q, k[:, :, lo:hi], v[:, :, lo:hi], 0.5))
    want = F.scaled_dot_product_attention(q, k, v, scale=0.5)
    assert np.allclose(out, want, rtol=1e-5, atol=1e-6)


def test_one_rank_ring_and_self_sendrecv():
    world = init_process_group("single")
    got = np.empty(3, np.float32)
    world.sendrecv(np.ones(3, np.float32), 0, got, 0)  # to and from itself: a copy
    assert np.array_equal(got, np.ones(3, np.float32))
    with pytest.raises(Exception, match="sends 12 bytes but receives 8"):
        world.sendrecv(np.ones(3, np.float32), 0, np.empty(2, np.float32), 0)
    with pytest.raises(ValueError, match="device addresses need a GPU backend"):
        world.sendrecv_start_device(1, 0, 2, 0, 8)
    r = ring.Ring(world)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 6, 4)).astype(np.float32) for _ in range(3))
    assert np.allclose(r.attention(q, k, v), F.scaled_dot_product_attention(q, k, v), rtol=1e-5, atol=1e-6)
