"""One rank of the Ulysses/CFG checks (started by tests/test_parallel.py under mpiexec).

Checks the exchanges against the unsharded computation in the same process: token split and
gather are exact inverses, Ulysses attention equals whole-sequence attention per head, and
CFG guidance is the same on every rank. A failure raises out of main, ending the job.
"""

from __future__ import annotations

import sys

import numpy as np

from hsdp import parallel
from hsdp.engine.config import DiffusionParallelConfig
from hsdp.world.distributed import init_process_group
from hsdp.nn import functional as F


def main() -> None:
    sp_degree, cfg_degree = int(sys.argv[1]), int(sys.argv[2])
    world = init_process_group()
    config = DiffusionParallelConfig(ulysses_degree=sp_degree, cfg_parallel_size=cfg_degree, use_hsdp=True)
    groups = parallel.init_parallel_groups(config, world)
    # the documented layout: rank = c * ulysses + u
    assert (groups.ulysses_rank, groups.cfg_rank) == (world.rank % sp_degree, world.rank // sp_degree)
    rng = np.random.default_rng(0)  # the same arrays on every rank
    b, h, n, d = 2, 4, 8 * sp_degree, 16
    if groups.sp is not None:
        sp = groups.sp
        assert sp.degree == sp_degree and sp.rank == groups.ulysses_rank
        x = rng.standard_normal((b, n, 32)).astype(np.float32)
        local = sp.split_tokens(x)
        assert local.shape == (b, n // sp_degree, 32)
        assert np.array_equal(sp.gather_tokens(local), x)
        q, k, v = (rng.standard_normal((b, h, n, d)).astype(np.float32) for _ in range(3))
        whole = F.scaled_dot_product_attention(q, k, v)
        lo, hi = sp.rank * (n // sp_degree), (sp.rank + 1) * (n // sp_degree)
        mine = sp.attention(q[:, :, lo:hi].copy(), k[:, :, lo:hi].copy(), v[:, :, lo:hi].copy(),
                            F.scaled_dot_product_attention)
        assert mine.shape == (b, h, hi - lo, d)
        # each head's attention over the whole sequence: the same products, batched alike
        assert np.array_equal(mine, whole[:, :, lo:hi]), np.abs(mine - whole[:, :, lo:hi]).max()
        # the reference model's path: q, k, v written into grouped() buffers, sent as they lie
        grouped = []
        for t in (q, k, v):
            g = sp.grouped(b, hi - lo, h, d, np.float32)
            g[...] = t[:, :, lo:hi].transpose(0, 2, 1, 3).reshape(g.shape)
            grouped.append(g)
        assert np.array_equal(sp.attention_grouped(*grouped, d, F.scaled_dot_product_attention), mine)
        try:
            sp.attention_grouped(q, k, v, d, F.scaled_dot_product_attention)  # not grouped() views
        except ValueError as e:
            assert "not a head-group-major view from Ulysses.grouped" in str(e), e
        else:
            raise AssertionError("a (B, H, n, D) array was taken for a grouped view")
        try:
            sp.attention(q[:, :3, lo:hi].copy(), k[:, :3, lo:hi].copy(), v[:, :3, lo:hi].copy(),
                         F.scaled_dot_product_attention)
        except ValueError as e:
            assert "num_heads=3" in str(e) and f"ulysses_degree={sp_degree}" in str(e), e
        else:
            raise AssertionError("3 heads over an even degree were accepted")
    cond = rng.standard_normal((2, 3)).astype(np.float32)
    uncond = rng.standard_normal((2, 3)).astype(np.float32)
    calls = []

    def branch(i: int) -> np.ndarray:
        calls.append(i)
        return cond if i == 0 else uncond

    guided = parallel.cfg_combine(groups, branch, 5.0)
    assert np.array_equal(guided, (uncond + np.float32(5.0) * (cond - uncond)).astype(np.float32))
    assert calls == ([groups.cfg_rank] if cfg_degree > 1 else [0, 1]), calls
    print(f"rank {world.rank}: parallel ok ({groups.describe()})", flush=True)


if __name__ == "__main__":
    main()
