"""Sequence parallel by a diffusers model's context-parallel plan (hsdp.parallel_torch) on real
ranks, with hsdp sharding the weights over the same ranks, and its refusals."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")  # torch is an optional dependency; make test installs it

from mpirun import run_ranks  # noqa: E402
from torch_models import make_flux, make_wan, wan_inputs  # noqa: E402

from hsdp import parallel  # noqa: E402
from hsdp.world.distributed import init_process_group  # noqa: E402
from hsdp.parallel.context import apply_sequence_parallel_torch  # noqa: E402


def test_wan_with_ulysses_and_hsdp_matches_the_unsharded_model():
    out = run_ranks(2, "tests/parallel_torch_worker.py", "float32", "bfloat16").stdout
    for dtype in ("float32", "bfloat16"):
        assert out.count(f"torch ulysses {dtype} ok on mpi") == 2, out


def test_models_without_a_plan_and_indivisible_heads_are_refused():
    from diffusers import SD3Transformer2DModel

    world = init_process_group("single")
    sp = parallel.Ulysses(world)
    tiny_sd3 = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
                                     num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                                     pooled_projection_dim=16, out_channels=4, pos_embed_max_size=8)
    with pytest.raises(NotImplementedError, match="SD3Transformer2DModel declares none .no _cp_plan.; give it one "
                                                  "with hsdp.parallel.context.register_plan"):
        apply_sequence_parallel_torch(tiny_sd3, sp)

    class Three:
        size, rank = 3, 0

    for model in (make_wan(0), make_flux(0)):
        with pytest.raises(ValueError, match="num_heads=2 is not divisible by ulysses_degree=3"):
            apply_sequence_parallel_torch(model, parallel.Ulysses(Three()))


def test_a_registered_plan_and_the_router_leave_other_calls_alone():
    """register_plan gives a class without one a plan; the router sends only calls carrying
    hsdp's attention to it, so a stock model in the same process computes as before."""
    from diffusers.models import attention_dispatch
    from diffusers.models._modeling_parallel import ContextParallelInput

    from hsdp.parallel import context

    class Planless(type(make_wan(0))):
        _cp_plan = None

    with pytest.raises(TypeError, match="non-empty dict"):
        context.register_plan(Planless, {})
    plan = {"": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)}}
    context.register_plan(Planless, plan)
    try:
        assert context.plan_of(Planless) is plan and context.plan_of(type(make_wan(0))) is not plan
    finally:
        context.PLANS.pop(Planless)
    world = init_process_group("single")
    stock = make_wan(0)
    args, kwargs = wan_inputs()
    with torch.inference_mode():
        before = stock(*args, **kwargs)[0]
        apply_sequence_parallel_torch(make_wan(0), parallel.Ulysses(world))  # installs the router
        assert attention_dispatch.dispatch_attention_fn is not context.route  # the dispatcher itself stays
        assert torch.equal(stock(*args, **kwargs)[0], before)
