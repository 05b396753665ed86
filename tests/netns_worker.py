"""One rank of the across-hosts check (tests/test_netns.py): two ranks in two network
namespaces joined by veth, Open MPI over TCP only. Sharded equals unsharded exactly, the
ranks see different hosts so every gather is collective (TCP), and with --bench a 16 MiB
unit gather is timed against the raw MPI_Allgather over the same link."""

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

        fns = [ours, lambda: world.all_gather(send, recv), unchecked]
        interleaved(fns, 2, sync=world.barrier)
        t_ours, t_raw, t_off = interleaved(fns, 25, sync=world.barrier)
        res.update(ours_s=t_ours, raw_s=t_raw, off_s=t_off)
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
