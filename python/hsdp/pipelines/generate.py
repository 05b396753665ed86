"""``generate``: run a pipeline call on every rank, decode on rank 0 only."""

from __future__ import annotations

from typing import Any

from .. import distributed


def generate(pipe: Any, **call_kwargs: Any) -> Any:
    """Call ``pipe(**call_kwargs)`` on every rank (every rank must call this: the sharded
    models' gathers are collectives) and return rank 0's output; None on the other ranks.

    Ranks other than 0 run with ``output_type="latent"``: the denoising loop is the same
    on every rank, but only rank 0 runs the VAE decode and the post-processing. Users who
    call ``pipe(...)`` directly can do the same (pass ``output_type="latent"`` where
    ``hsdp.distributed.get_rank() != 0``)."""
    rank = distributed.init_process_group().rank
    if rank != 0:
        call_kwargs = {**call_kwargs, "output_type": "latent"}
    out = pipe(**call_kwargs)
    return out if rank == 0 else None
