"""Data-parallel lanes: a batch of items spread over the lanes, each lane running the stock
pipeline call for its own items, in lockstep where they share a shard group
(:mod:`hsdp.engine.lockstep`); rank 0 gets every item's output, in order.

An *item* is one output of the call: prompt j's k-th video when ``num_videos_per_prompt`` is
k. Item i belongs to lane i mod D, and each lane runs its items as one stock call of their own
(:func:`lane_call`: every list of the batch cut to them: prompt, negative prompt, generator,
image, ...; one output per prompt), so item i equals the stock pipeline called with it alone,
up to the rounding of a batch (a lane holds 1/D of the batch a single call would). Every lane
decodes its own items (the VAE is replicated); only each lane's leader decodes (the other
ranks of a lane run with ``output_type="latent"``), or with ``vae_patch_parallel_size=N``
the lane's first N ranks, each its share of the tiles (the leader writes), and the leaders'
outputs go to rank 0 in one gather at the end.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..engine.lockstep import Lockstep
from .state import PipelineState, pipeline_state

# The arguments that hold one entry per prompt (cut to an item's prompt), and the one entry
# per output (cut to the item itself), of diffusers' video and image pipelines.
PER_PROMPT = ("prompt", "prompt_2", "negative_prompt", "negative_prompt_2", "image", "last_image", "video")
PER_OUTPUT = ("generator", "latents")
PER_PROMPT_COUNTS = ("num_videos_per_prompt", "num_images_per_prompt")


class LanePeerFailed(RuntimeError):
    """Raised on a rank that stops a call because another rank of its lane failed (a step
    agreement within the lane, as ``hsdp serve``'s): :func:`run_lanes` then reports the failing
    rank's own error for the call, not this one."""


def _is_list(v: Any) -> bool:
    return isinstance(v, (list, tuple))


def items_of(call: dict[str, Any]) -> list[dict[str, Any]]:
    """The call cut into one call per output, in the pipeline's output order (prompt by
    prompt, each prompt's outputs together). A lone generator cannot be cut: a list of one per
    output is asked for (each output is then reproducible on its own), unless there is one
    output."""
    prompt = call.get("prompt")
    n_prompts = len(prompt) if _is_list(prompt) else 1
    per = 1
    for key in PER_PROMPT_COUNTS:
        if call.get(key) is not None:
            per = int(call[key])
    n = n_prompts * per
    gen = call.get("generator")
    if n > 1 and gen is not None and not _is_list(gen):
        raise ValueError(
            f"with data parallel lanes, give one generator per output (a list of {n}: {n_prompts} prompt(s) x "
            f"{per} output(s) each), not one for the whole batch: each output runs alone on its lane, and its "
            "generator makes it the same as the stock pipeline called with that output alone"
        )
    out = []
    for i in range(n):
        j = i // per
        one = dict(call)
        for key in PER_PROMPT:
            v = call.get(key)
            if _is_list(v) and n_prompts > 1:
                one[key] = v[j] if len(v) == n_prompts else v
        for key in PER_OUTPUT:
            v = call.get(key)
            if _is_list(v):
                one[key] = v[i]
            elif key == "latents" and v is not None and getattr(v, "shape", (1,))[0] == n and n > 1:
                one[key] = v[i : i + 1]
        for key in PER_PROMPT_COUNTS:
            if key in one:
                one[key] = 1
        out.append(one)
    return out


def lane_call(items: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One stock call for several items cut from the same call (:func:`items_of`): their
    per-prompt and per-output arguments as lists, in item order."""
    if len(items) == 1:
        return dict(items[0])
    call = dict(items[0])
    for key in PER_PROMPT + ("generator",):
        if key not in call or call[key] is None:
            continue
        # the prompt and the generators go per item; another argument stays one value when
        # every item shares it (one negative prompt for all, say)
        if key in ("prompt", "generator") or not all(it.get(key) is call[key] for it in items):
            call[key] = [it[key] for it in items]
    if call.get("latents") is not None:
        import torch

        call["latents"] = torch.cat([it["latents"] for it in items], dim=0)
    return call


def split_output(out: Any, n: int) -> list[Any]:
    """A stock output of n items as n outputs of one (the inverse of joining them)."""
    import dataclasses

    if n == 1:
        return [out]
    parts: list[dict[str, Any]] = [{} for _ in range(n)]
    for f in dataclasses.fields(out):
        value = getattr(out, f.name)
        for i in range(n):
            parts[i][f.name] = value[i : i + 1] if value is not None else None
    return [type(out)(**p) for p in parts]


def _gather_objects(world: Any, obj: Any) -> list[Any]:
    """Every rank's `obj`, on every rank (pickled; two all-gathers: the sizes, then the bytes)."""
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    sizes = np.empty(world.size, dtype=np.int64)
    world.all_gather(np.array([data.size], dtype=np.int64), sizes)
    width = int(sizes.max())
    mine = np.zeros(width, dtype=np.uint8)
    mine[: data.size] = data
    every = np.empty(width * world.size, dtype=np.uint8)
    world.all_gather(mine, every)
    return [pickle.loads(every[r * width : r * width + int(sizes[r])].tobytes()) for r in range(world.size)]


def join_outputs(outputs: Sequence[Any]) -> Any:
    """The stock output type with every item's output in order: each field's batch joined."""
    import dataclasses

    import torch

    first = outputs[0]
    fields = [f.name for f in dataclasses.fields(first)] if dataclasses.is_dataclass(first) else None
    if fields is None:
        raise TypeError(f"cannot join pipeline outputs of type {type(first).__name__} (not a diffusers output)")
    joined = {}
    for name in fields:
        parts = [getattr(o, name) for o in outputs]
        if all(isinstance(p, np.ndarray) for p in parts):
            joined[name] = np.concatenate(parts, axis=0)
        elif all(isinstance(p, torch.Tensor) for p in parts):
            joined[name] = torch.cat(parts, dim=0)
        elif all(isinstance(p, list) for p in parts):
            joined[name] = [x for p in parts for x in p]
        else:
            joined[name] = parts[0] if all(p is None for p in parts) else parts
    return type(first)(**joined)


def run_items(pipe: Any, items: Sequence[dict[str, Any]], world: Any, groups: Any) -> list[Any] | None:
    """The items of one batch (:func:`items_of`) spread over the lanes: lane d runs items d,
    d + D, ... as one stock call (:func:`lane_call`). Every item's output, in order, on rank 0
    (None elsewhere)."""
    lanes = groups.dp_degree
    per_lane = [list(range(d, len(items), lanes)) for d in range(lanes)]
    calls = [lane_call([items[i] for i in idx]) if idx else None for idx in per_lane]
    outs, errors = run_lanes(pipe, calls, world, groups)
    failed = [e for e in errors if e is not None]
    if failed:
        raise RuntimeError("data parallel lanes failed: " + "; ".join(failed[:4]) + (" ..." if len(failed) > 4 else ""))
    if world.rank != 0:
        return None
    result: list[Any] = [None] * len(items)
    for d, idx in enumerate(per_lane):
        if idx:
            for i, one in zip(idx, split_output(outs[d], len(idx)), strict=True):
                result[i] = one
    return result


def run_lanes(pipe: Any, calls: Sequence[dict[str, Any] | None], world: Any, groups: Any,
              before: Any = None) -> tuple[list[Any], list[str | None]]:
    """Runs calls spread over the lanes (call i on lane i mod D, in rounds; a None call runs
    nothing), the lanes in lockstep; a call that fails fails alone (between two forwards: an
    error inside one would leave the other lanes waiting in its gathers) and its lane runs no
    more calls, serving the others. Every rank calls it with the same calls; returns every call's
    output (on rank 0; None elsewhere) and error (on every rank, None where it succeeded).
    ``before(i)``, when given, runs on the ranks of call i's lane just before it."""
    lanes, lane, leader = groups.dp_degree, groups.dp_rank, groups.lane_rank == 0
    decodes = groups.lane_rank < decoding_ranks(pipe)  # the lane's leader, and its VAE ranks
    mine: list[tuple[int, Any]] = []
    failed: list[tuple[int, str, bool]] = []  # (call, error, whether the error is this rank's own)
    for i in range(lane, len(calls), lanes):
        if calls[i] is None:
            continue
        call = calls[i] if decodes else {**calls[i], "output_type": "latent"}
        try:
            if before is not None:  # this lane's own setup for call i (serve: the job's step cache)
                before(i)
            out = pipe(**call)
        except Exception as exc:  # noqa: BLE001 - the call's outcome; the other lanes go on
            failed.append((i, f"{type(exc).__name__}: {exc}", not isinstance(exc, LanePeerFailed)))
            break  # this lane only serves from now on
        if leader:
            mine.append((i, out))
    ls = pipeline_state(pipe).lockstep if isinstance(getattr(pipe, "_hsdp", None), PipelineState) else None
    if ls is not None:
        ls.finish()  # serve the other lanes until every lane is done
    every = _gather_objects(world, (mine if leader else [], failed))
    outputs: list[Any] = [None] * len(calls)
    errors: list[str | None] = [None] * len(calls)
    own = [False] * len(calls)
    for rank, (part, errs) in enumerate(every):
        for i, out in part:
            outputs[i] = out
        for i, err, first_hand in errs:
            # the lowest failing rank's words (as serve's agree_outcome), preferring a rank's
            # own failure to a peer's LanePeerFailed: a lane's second rank failing alone is named
            if errors[i] is None or (first_hand and not own[i]):
                errors[i] = err if rank == 0 else f"rank {rank}: {err}"
                own[i] = first_hand
    return (outputs if world.rank == 0 else [None] * len(calls)), errors


def decoding_ranks(pipe: Any) -> int:
    """How many ranks of each request run the VAE decode: 1 (the leader), or the ranks
    ``vae_patch_parallel_size`` spreads its tiles over."""
    state = getattr(pipe, "_hsdp", None)
    return state.vae_ranks if isinstance(state, PipelineState) else 1


def lane_groups(pipe: Any) -> Any:
    """The parallel groups of a pipeline loaded with data-parallel lanes, else None."""
    state = getattr(pipe, "_hsdp", None)
    groups = getattr(state, "groups", None) if isinstance(state, PipelineState) else None
    return groups if groups is not None and groups.dp_degree > 1 else None


def install_lockstep(pipe: Any, models: Sequence[Any]) -> Lockstep | None:
    """One ballot for the pipeline's sharded models (one shard group: one config), registered
    in the given (load) order, the same on every rank; None when nothing is sharded."""
    ls: Lockstep | None = None
    for model in models:
        ctx = getattr(model, "_hsdp_context", None)
        if ctx is None or ctx.schedule is None:
            continue
        if ls is None:
            ls = Lockstep(ctx.mesh.shard_group)
        elif ctx.mesh.shard_group is not ls.group:
            raise ValueError("data parallel lanes need every sharded model of the pipeline on one shard group")
        ls.register(ctx.schedule)
    return ls
