"""Across hosts over TCP: a 16 MiB unit gather against the raw MPI_Allgather of the same
bytes, with two ranks in two network namespaces joined by veth (bench/netns.py; root and
`ip netns` needed), Open MPI's TCP transport only. The ranks see different hosts, so the
unit's gathers are collective (with the agreement check), as between real hosts; the model
check (sharded equals unsharded) runs first. Library defaults otherwise. Then a 16 MiB
bfloat16 unit's gather with the float8 wire against the same unit without it; with
--wire-piece=N[,M...] the float8 unit's gather also with its chunk sent in pieces of N bytes
(hsdp._C._set_wire_piece_bytes), each decoded as it lands, interleaved with the rest.

    .venv/bin/python bench/bench_tcp.py [--wire-piece=262144,1048576]
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import netns  # noqa: E402
from harness import machine, table  # noqa: E402


def main() -> None:
    pieces = [a for a in sys.argv[1:] if a.startswith("--wire-piece=")]
    out = netns.run_on_two_hosts(["tests/netns_worker.py", "--bench", *pieces], HERE.parent, "bench_tcp")
    # each rank's RESULT object (nested: the pieces), read where it starts: the ranks' lines
    # may run into each other in mpiexec's output
    rows = sorted((json.JSONDecoder().raw_decode(out, m.end())[0] for m in re.finditer(r"RESULT ", out)),
                  key=lambda r: r["rank"])
    print(f"16 MiB unit gather vs raw MPI_Allgather, 2 ranks in 2 network namespaces over TCP (veth), {machine()}; "
          "median ms")
    print(table(["rank", "host", "sharded == unsharded", "gather path", "raw ms", "hsdp ms", "hsdp, check off ms",
                 "raw / hsdp"],
                [[r["rank"], r["host"], r["exact"], "/".join(r["paths"]), f"{r['raw_s'] * 1e3:.2f}",
                  f"{r['ours_s'] * 1e3:.2f}", f"{r['off_s'] * 1e3:.2f}", f"{r['raw_s'] / r['ours_s']:.3f}"]
                 for r in rows]))
    print()
    print("16 MiB bfloat16 unit gathered as bfloat16 and with the float8 wire (wire_dtype='float8_e4m3fn'), "
          "same link; median ms")
    print(table(["rank", "bfloat16 ms", "float8 wire ms", "float8 wire MiB", "raw all-gather of those MiB ms",
                 "float8 / bfloat16"],
                [[r["rank"], f"{r['bf16_s'] * 1e3:.2f}", f"{r['fp8_s'] * 1e3:.2f}", f"{r['wire_mib']:.2f}",
                  f"{r['raw8_s'] * 1e3:.2f}", f"{r['fp8_s'] / r['bf16_s']:.3f}"] for r in rows]))
    if rows and rows[0]["pieces"]:
        print()
        print("the float8 wire's chunk in pieces, each decoded as it lands; median ms (float8 / bfloat16)")
        sizes = list(rows[0]["pieces"])
        print(table(["rank", "one message", *(f"pieces of {int(p) >> 10} KiB" for p in sizes)],
                    [[r["rank"], f"{r['fp8_s'] * 1e3:.2f} ({r['fp8_s'] / r['bf16_s']:.3f})",
                      *(f"{r['pieces'][p] * 1e3:.2f} ({r['pieces'][p] / r['bf16_s']:.3f})" for p in sizes)]
                     for r in rows]))


if __name__ == "__main__":
    main()
