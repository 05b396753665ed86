"""One rank of the NCCL bootstrap tests: exchanges a made-up unique id the way the NCCL
backend does (an MPI broadcast under mpiexec, torch's TCPStore under torchrun's variables)
and prints what it got. No GPU is needed: the id bytes are random, not ncclGetUniqueId's."""

from __future__ import annotations

import hashlib
import os
import sys

from hsdp.world import nccl


def main() -> None:
    timeout = float(sys.argv[1]) if len(sys.argv) > 1 else 30.0
    info = nccl.launch_info()
    made: list[bytes] = []

    def make_id() -> bytes:
        made.append(os.urandom(nccl.ID_BYTES))
        return made[-1]

    try:
        uid, rank, size = nccl.exchange_unique_id(make_id, info, timeout)
    except RuntimeError as exc:
        print(f"ERROR {exc}", flush=True)
        sys.exit(3)
    # only rank 0 makes the id; every rank ends with rank 0's bytes
    assert (len(made) == 1) == (rank == 0), (rank, len(made))
    assert not made or made[0] == uid
    print(f"via={info.via} rank={rank} size={size} len={len(uid)} id={hashlib.sha256(uid).hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
