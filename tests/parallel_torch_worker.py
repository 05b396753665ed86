"""One rank of the torch Ulysses check (started by tests/test_parallel_torch.py under mpiexec).

`python tests/parallel_torch_worker.py DTYPE...`: for each dtype, a tiny diffusers Wan transformer, sharded by
hsdp over the world and run with Ulysses over the same ranks, against the unsharded model
with the stock processors in this process: within 1e-5 relative in float32 (bfloat16: 2e-2).
"""

from __future__ import annotations

import sys

import torch

import hsdp
from hsdp import parallel
from hsdp.parallel.context import apply_sequence_parallel_torch
from torch_models import check_on_device, is_wan_block, make_wan, target_device, worker_world, wan_inputs


def main() -> None:
    for dtype in sys.argv[1:]:  # one launch, several dtypes: each launch costs a torch import per rank
        check(dtype)


def check(dtype: str) -> None:
    world = worker_world()
    sp = parallel.Ulysses(world)
    args, kwargs = wan_inputs()
    ref = make_wan(0)
    model = make_wan(0)
    if dtype == "bfloat16":
        from hsdp.adapters.torch import unsharded_reference

        ref._hsdp_shard_conditions = [is_wan_block]
        unsharded_reference(ref, "bfloat16")
    model._hsdp_shard_conditions = [is_wan_block]
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, param_dtype=dtype),
                             target_device=target_device(world))
    check_on_device(world, model)
    apply_sequence_parallel_torch(model, sp)
    with torch.inference_mode():
        expect = ref(*args, **kwargs)[0].float()
        for _ in range(2):
            got = model(*args, **kwargs)[0].float()
            rel = ((got - expect).abs().max() / expect.abs().max()).item()
            assert rel <= (1e-5 if dtype == "float32" else 2e-2), rel
    print(f"rank {world.rank}: torch ulysses {dtype} ok on {world.backend}, relative {rel:.3g}", flush=True)


if __name__ == "__main__":
    main()
