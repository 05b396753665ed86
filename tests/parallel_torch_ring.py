"""The torch half of tests/ring_worker.py (and of tests/nccl_torch_fake.py): a tiny diffusers
Wan transformer, sharded by hsdp over the world and run with ring attention / USP over the
same ranks (and CFG parallel when the layout has it; CFG parallel alone when it has no
sequence split), against the unsharded model with the stock processors in this process,
float32, within 1e-5 relative."""

from __future__ import annotations

from typing import Any

import torch

import hsdp
from hsdp.parallel.context import apply_sequence_parallel_torch, cfg_combine
from torch_models import is_wan_block, make_wan, wan_inputs


def check_wan(groups: Any, target_device: str | None = None) -> float:
    """The check; returns the relative difference. target_device: where the units' buffers
    go (tests/torch_models.target_device)."""
    from hsdp.parallel.attention import SequenceParallelAttention

    args, kwargs = wan_inputs()  # 32 tokens
    x, t, ctx = args
    ref = make_wan(0, layers=2)
    model = make_wan(0, layers=2)
    model._hsdp_shard_conditions = [is_wan_block]
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, param_dtype="float32"),
                             target_device=target_device)
    if groups.sp is not None:  # else CFG parallel alone: each rank runs its branch's tokens whole
        apply_sequence_parallel_torch(model, groups.sp)
        assert isinstance(model.blocks[0].attn1.processor._parallel_config, SequenceParallelAttention)
    with torch.inference_mode():
        def run(m: Any, g: Any) -> torch.Tensor:
            return cfg_combine(g, lambda i: m(x, t, ctx * (1 - i), **kwargs)[0], 5.0)

        from hsdp.parallel import SINGLE

        expect = run(ref, SINGLE)
        got = run(model, groups)
    rel = ((got - expect).abs().max() / expect.abs().max()).item()
    assert rel <= 1e-5, f"Wan, {groups.describe()}: relative {rel:.3g}"
    return rel
