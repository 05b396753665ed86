"""Figure 7's bound: what a sharded forward must add at least, on this machine's memory.

Every sharded forward writes each unit's gathered weights again; an unsharded forward only
reads them. For the ``base`` preset (9 units of 16 MiB in float32, the dtype NumPy computes
in; 8 MiB each in bfloat16, the default storage), two processes at once (as two ranks on
one host run) time per forward:
  * copy: 9 plain copies of 16 MiB of float32 (the least a gather can write);
  * widen: 9 widenings of 8 MiB of bfloat16 into 16 MiB of float32 (the conversion NumPy
    needs after a bfloat16 gather).
Divide by the unsharded forward of ``bench_forward.py`` at the same moment for the bound.

    .venv/bin/python bench/bench_forward_bound.py
"""

from __future__ import annotations

import subprocess
import sys
import time

UNITS, F32_BYTES = 9, 16 * 2**20


def rank(r: int) -> None:
    import numpy as np

    n = F32_BYTES // 4
    src, dst = np.ones(n, np.float32), np.empty(n, np.float32)
    half, wide = np.ones(n, np.uint16), np.empty(n, np.uint32)
    copy, widen = [], []
    for _ in range(15):
        t = time.perf_counter()
        for _ in range(UNITS):
            np.copyto(dst, src)
        copy.append(time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(UNITS):
            np.left_shift(half, 16, out=wide, dtype=np.uint32)  # bfloat16 bits -> float32 bits
        widen.append(time.perf_counter() - t)
    print(f"process {r}: per forward, copy {np.median(copy) * 1e3:.1f} ms, widen {np.median(widen) * 1e3:.1f} ms "
          f"(medians of 15)", flush=True)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--rank":
        rank(int(sys.argv[2]))
        return
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r)]) for r in range(2)]
    if any(p.wait() for p in procs):
        raise SystemExit("bench_forward_bound: a process failed")


if __name__ == "__main__":
    main()
