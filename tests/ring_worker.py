"""One rank of the ring attention / USP checks (started by tests/test_ring.py under mpiexec).

One launch runs every layout its world size allows (2 ranks: ring 2; 4 ranks: ring 4,
Ulysses 2 x ring 2, ring 2 x CFG 2), each against the unsharded computation in this same
process: the point-to-point exchange, ring attention, and the reference model's forward, fp32
within 1e-5 relative. With ``torch`` as the last argument it also runs the diffusers Wan
transformer through hsdp.parallel_torch (the 4-rank launch, which has Ulysses x ring and
ring x CFG: one torch import, the suite's time). A failure raises out of main, ending the job.
"""

from __future__ import annotations

import sys

import numpy as np

from hsdp import models, parallel
from hsdp.engine.config import DiffusionParallelConfig
from hsdp.world.distributed import init_process_group
from hsdp.nn import functional as F

RTOL = 1e-5


def close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    rel = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
    assert got.shape == want.shape and rel <= RTOL, f"{what}: relative difference {rel:.3g} (shape {got.shape})"


def check_sendrecv(world) -> None:
    r, n = world.rank, world.size
    mine = np.arange(6, dtype=np.float32) + 10 * r
    got = np.empty_like(mine)
    world.sendrecv(mine, (r + 1) % n, got, (r - 1) % n)
    assert np.array_equal(got, np.arange(6, dtype=np.float32) + 10 * ((r - 1) % n)), got
    world.sendrecv_start(mine * 2, (r - 1) % n, got, (r + 1) % n)
    world.sendrecv_wait()
    assert np.array_equal(got, (np.arange(6, dtype=np.float32) + 10 * ((r + 1) % n)) * 2), got
    for bad, match in (((mine, n, got, 0), "dest=%d is outside" % n), ((mine, 0, got, -1), "source=-1")):
        try:
            world.sendrecv(*bad)
        except ValueError as e:
            assert match in str(e), e
        else:
            raise AssertionError(f"sendrecv{bad[1:2]} was accepted")
    try:
        world.sendrecv_wait()
    except RuntimeError as e:
        assert "no sendrecv was started" in str(e), e
    else:
        raise AssertionError("a wait with nothing started was accepted")


def check_layout(world, uly: int, ring: int, cfg: int, torch_too: bool) -> None:
    config = DiffusionParallelConfig(ulysses_degree=uly, ring_degree=ring, cfg_parallel_size=cfg, use_hsdp=True)
    groups = parallel.init_parallel_groups(config, world)
    sp = groups.sp
    s, c = world.rank % (uly * ring), world.rank // (uly * ring)
    # yunchang's layout: Ulysses groups consecutive, ring groups strided by the Ulysses degree
    assert (groups.ulysses_rank, groups.ring_rank, groups.cfg_rank) == (s % uly, s // uly, c), groups
    assert sp.degree == uly * ring and sp.rank == s and sp.ring.degree == ring
    assert sp.ring.group.size == ring and (sp.ulysses is None) == (uly == 1)
    rng = np.random.default_rng(0)  # the same arrays on every rank
    b, h, n, d = 2, 4, 8 * uly * ring, 16
    q, k, v = (rng.standard_normal((b, h, n, d)).astype(np.float32) for _ in range(3))
    whole = F.scaled_dot_product_attention(q, k, v)
    lo, hi = s * (n // sp.degree), (s + 1) * (n // sp.degree)
    mine = sp.attention(q[:, :, lo:hi].copy(), k[:, :, lo:hi].copy(), v[:, :, lo:hi].copy(),
                        F.scaled_dot_product_attention)
    close(mine, whole[:, :, lo:hi], f"attention, {groups.describe()}")
    # the reference model, sequence-parallel, against the same model whole
    model = models.make_model("tiny")
    x, t, ctx = models.make_inputs("tiny", frames=2, height=8, width=8)  # 32 tokens
    want = model(x, t, ctx)
    parallel.apply_sequence_parallel(model, sp)
    close(model(x, t, ctx), want, f"VideoDiT forward, {groups.describe()}")
    guided = parallel.cfg_combine(groups, lambda i: model(x, t, ctx * (1 - i)), 5.0)
    parallel.apply_sequence_parallel(model, None)
    close(guided, parallel.cfg_combine(parallel.SINGLE, lambda i: model(x, t, ctx * (1 - i)), 5.0), "CFG")
    try:
        sp.split_tokens(np.zeros((1, 9 * sp.degree + 1, 4), np.float32))
    except ValueError as e:
        assert f"not divisible by {sp.degree}" in str(e), e
    else:
        raise AssertionError("a sequence that does not divide was accepted")
    if torch_too and (uly, ring, cfg) != (1, 4, 1):  # the torch path once per kind: USP, ring x CFG
        from parallel_torch_ring import check_wan

        check_wan(groups)
    print(f"rank {world.rank}: ring ok ({groups.describe()})", flush=True)


def main() -> None:
    world = init_process_group()
    torch_too = sys.argv[-1] == "torch"
    check_sendrecv(world)
    layouts = {2: [(1, 2, 1)], 4: [(2, 2, 1), (1, 2, 2), (1, 4, 1)]}[world.size]
    for uly, ring, cfg in layouts:
        check_layout(world, uly, ring, cfg, torch_too)


if __name__ == "__main__":
    main()
