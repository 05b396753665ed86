"""One rank of the across-hosts check (tests/test_netns.py): two ranks in two network
namespaces joined by veth, Open MPI over TCP only. Sharded equals unsharded exactly, the
ranks see different hosts so every gather is collective (TCP), and with --bench a 16 MiB
unit gather is timed against the raw MPI_Allgather over the same link, and a 16 MiB bfloat16
unit's gather with the float8 wire against without it."""

from __future__ import annotations

import json
import socket
import sys

import numpy as np

import hsdp
from hsdp import _C, models


def main() -> None:
    world = hsdp.distributed.init_process_group()
    x = models.make_inputs(models.DiTConfig.preset("tiny"), seed=3)
    ref = models.make_model("tiny", seed=0)(*x)
    model = models.make_model("tiny", seed=0)
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, param_dtype="float32"))
    outs = [model(*x) for _ in range(3)]
    paths = sorted({u.unit.gather_path for u in hsdp.get_units(model)})
    res = {"rank": world.rank, "host": socket.gethostname(), "exact": all(np.array_equal(o, ref) for o in outs),
           "paths": paths}
    if "--bench" in sys.argv:
        sys.path.insert(0, "bench")
        from harness import interleaved

        nbytes = 16 << 20
        unit = _C.Unit(world, ["float32"], [(nbytes // 4,)], name="16MiB")
        send, recv = _C.empty_aligned(unit.chunk_bytes), _C.empty_aligned(unit.total_bytes)

        def ours() -> None:
            unit.unshard()
            unit.reshard()

        def unchecked() -> None:  # what the agreement check costs over the link
            _C._set_agreement_check(False)
            ours()
            _C._set_agreement_check(True)

        # a 16 MiB bfloat16 unit, gathered as bfloat16 and with the float8 wire
        n = nbytes // 2
        values = (np.random.default_rng(0).standard_normal(n) * 0.02).astype(np.float32)
        wire_units = []
        for wire in (None, "float8_e4m3fn"):
            u = _C.Unit(world, ["bfloat16"], [(n,)], name=f"16MiB-{wire}", compute_dtypes=["bfloat16"],
                        wire_dtype=wire)
            u.write(0, values)
            wire_units.append(u)

        def gather(u, piece: int = 0):
            def run() -> None:
                u.unshard()
                u.reshard()

            def in_pieces() -> None:  # --wire-piece only; the default is one message
                _C._set_wire_piece_bytes(piece)
                try:
                    run()
                finally:
                    _C._set_wire_piece_bytes(0)
            return in_pieces if piece else run

        # --wire-piece=N,M: the float8 unit's gather also in pieces of N (and M) bytes
        pieces = [int(v) for a in sys.argv if a.startswith("--wire-piece=") for v in a.split("=", 1)[1].split(",")]

        # the raw MPI_Allgather of the float8 bytes alone: what the link costs them
        wire_chunk = wire_units[1].wire_chunk_bytes
        send8, recv8 = _C.empty_aligned(wire_chunk), _C.empty_aligned(wire_chunk * world.size)
        fns = [ours, lambda: world.all_gather(send, recv), unchecked, *map(gather, wire_units),
               lambda: world.all_gather(send8, recv8), *(gather(wire_units[1], p) for p in pieces)]
        interleaved(fns, 2, sync=world.barrier)
        t_ours, t_raw, t_off, t_bf16, t_fp8, t_raw8, *t_pieces = interleaved(fns, 25, sync=world.barrier)
        res.update(ours_s=t_ours, raw_s=t_raw, off_s=t_off, bf16_s=t_bf16, fp8_s=t_fp8, raw8_s=t_raw8,
                   wire_mib=wire_chunk * world.size / 2**20, pieces={str(p): t for p, t in zip(pieces, t_pieces)})
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
