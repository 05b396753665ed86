"""``generate``: run a pipeline call on every rank, decode on rank 0 only."""

from __future__ import annotations

from typing import Any

from ..world import distributed
from .lanes import decoding_ranks, items_of, join_outputs, lane_groups, run_items


def _count(value: Any) -> int | None:
    """How many entries a list or tuple argument holds; None for a single value."""
    return len(value) if isinstance(value, (list, tuple)) else None


def check_batch(call_kwargs: dict[str, Any]) -> None:
    """Refuse a call whose lists disagree about the batch, before any model runs: a negative
    prompt list of another length than the prompt list, or a generator list of another
    length than the batch times the outputs per prompt (diffusers finds both only after
    encoding the prompt, or not at all). Every rank gets the same call, so every rank raises."""
    prompt = call_kwargs.get("prompt")
    n_prompt = _count(prompt)
    if n_prompt == 0:
        raise ValueError("prompt is an empty list: give at least one prompt")
    if prompt is None and call_kwargs.get("prompt_embeds") is None:
        raise ValueError("prompt is missing: give prompt (a string or a list of strings) or prompt_embeds")
    batch = n_prompt if n_prompt is not None else 1
    n_neg = _count(call_kwargs.get("negative_prompt"))
    if n_neg is not None and n_prompt is not None and n_neg != n_prompt:
        raise ValueError(f"negative_prompt has {n_neg} entries but prompt has {n_prompt}: give one per prompt "
                         "(or a single string for all)")
    if n_neg is not None and n_neg != 1 and n_prompt is None:
        raise ValueError(f"negative_prompt has {n_neg} entries for a single prompt: a prompt list of {n_neg} "
                         "prompts, or one negative prompt")
    per_prompt = call_kwargs.get("num_videos_per_prompt", call_kwargs.get("num_images_per_prompt")) or 1
    n_gen = _count(call_kwargs.get("generator"))
    if n_gen is not None and n_gen != batch * per_prompt:
        raise ValueError(f"generator is a list of {n_gen} generators, but the batch is {batch} prompt(s) x "
                         f"{per_prompt} output(s) each = {batch * per_prompt}: give one generator, or one per output")


def generate(pipe: Any, **call_kwargs: Any) -> Any:
    """Call ``pipe(**call_kwargs)`` on every rank (every rank must call this: the sharded
    models' gathers are collectives) and return rank 0's output; None on the other ranks.

    The lists of the call are checked against each other first (:func:`check_batch`).
    Ranks other than 0 run with ``output_type="latent"``: the denoising loop is the same
    on every rank, but only rank 0 runs the VAE decode and the post-processing. Users who
    call ``pipe(...)`` directly can do the same (pass ``output_type="latent"`` where
    ``hsdp.distributed.get_rank() != 0``). With ``vae_patch_parallel_size=N`` ranks 0 to
    N - 1 decode, each its share of the tiles (:mod:`hsdp.pipelines.vae`); rank 0 writes.

    With data parallel lanes (``data_parallel_size=D``) the batch's outputs are spread over
    the lanes instead (:mod:`hsdp.pipelines.lanes`): output i runs on lane i mod D, in one
    stock call per lane of its outputs, so it equals the stock pipeline called with it alone
    (up to a batch's rounding), and rank 0 returns the stock output type with every output in
    order. A list of one generator per output is asked for."""
    check_batch(call_kwargs)
    world = distributed.init_process_group()
    rank = world.rank
    groups = lane_groups(pipe)
    if groups is not None:
        outputs = run_items(pipe, items_of(call_kwargs), world, groups)
        return join_outputs(outputs) if outputs is not None else None
    if rank >= decoding_ranks(pipe):
        call_kwargs = {**call_kwargs, "output_type": "latent"}
    out = pipe(**call_kwargs)
    return out if rank == 0 else None
