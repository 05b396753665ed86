"""The ranks an :class:`hsdp.Omni` started: rank 0 talks to the caller's process over an
authenticated local connection (``multiprocessing.connection``: the address and key in
:data:`ADDRESS_ENV` and :data:`AUTHKEY_ENV`) and broadcasts each message to every rank; every
rank then does what it says: load the pipeline (:func:`hsdp.pipelines.load_pipeline`), run a
request's prompts (:func:`hsdp.pipelines.generate`, or over the data-parallel lanes with
:func:`hsdp.pipelines.lanes.run_lanes`, as ``hsdp serve`` does), or stop.

The caller going away (``close()``, its exit, or its death: the connection ends) stops every
rank the same way, so the launcher's job ends and it removes the job's files. While idle,
rank 0 tells the others it is alive well inside ``HSDP_TIMEOUT``, as ``hsdp serve`` does.
"""

from __future__ import annotations

import inspect
import os
import pickle
import traceback
from typing import Any

import numpy as np

__all__ = ["ADDRESS_ENV", "AUTHKEY_ENV", "main"]

ADDRESS_ENV = "HSDP_OMNI_ADDRESS"  # host:port of the caller's listener
AUTHKEY_ENV = "HSDP_OMNI_AUTHKEY"  # hex of the connection's key


def _beat_seconds() -> float:
    from hsdp.world import distributed

    timeout = distributed.get_timeout()
    return 5.0 if timeout <= 0 else max(0.05, min(5.0, timeout / 4))


def _broadcast(world: Any, message: Any) -> Any:
    """Rank 0's ``message`` (any picklable object) on every rank."""
    from hsdp.world.messages import broadcast_bytes

    return pickle.loads(broadcast_bytes(world, pickle.dumps(message) if world.rank == 0 else None))


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _agree(world: Any, err: BaseException | None, step: str) -> None:
    from hsdp.checkpoint.stream import _Agreement

    _Agreement(world)(err, 0, step)


def _load(spec: dict[str, Any]) -> Any:
    import torch

    from hsdp.pipelines import load_pipeline

    dtype = getattr(torch, spec["dtype"])
    return load_pipeline(spec["model"], spec["parallel_config"], dtype=dtype, device=spec["device"],
                         shard_text_encoders=spec["shard_text_encoders"], progress=False, **spec["kwargs"])


def _calls(pipe: Any, request: dict[str, Any]) -> list[dict[str, Any]]:
    """One pipeline call per prompt of the request (every rank builds the same)."""
    import torch

    accepted = set(inspect.signature(type(pipe).__call__).parameters)
    calls = []
    for i, (prompt, params) in enumerate(zip(request["prompts"], request["params"], strict=True)):
        call: dict[str, Any] = {"output_type": "np"}
        if isinstance(prompt, str):
            call["prompt"] = prompt
        else:  # vllm-omni's dict prompt: prompt, negative_prompt, multi_modal_data={"image": ...}
            call["prompt"] = prompt.get("prompt")
            if prompt.get("negative_prompt") is not None:
                call["negative_prompt"] = prompt["negative_prompt"]
            image = (prompt.get("multi_modal_data") or {}).get("image")
            if image is not None:
                call["image"] = image
        for name in ("num_inference_steps", "guidance_scale", "guidance_scale_2", "true_cfg_scale", "height",
                     "width", "num_frames", "max_sequence_length"):
            value = getattr(params, name)
            if value is not None:
                call[name] = value
        if params.num_outputs_per_prompt > 1:
            key = "num_videos_per_prompt" if "num_videos_per_prompt" in accepted else "num_images_per_prompt"
            call[key] = params.num_outputs_per_prompt
        if params.generator is not None:
            gen = params.generator
            call["generator"] = gen[i] if isinstance(gen, (list, tuple)) else gen
        else:
            call["generator"] = torch.Generator("cpu").manual_seed(int(request["seeds"][i]))
        call.update(params.extra_args)
        unknown = sorted(k for k in call if k not in accepted)
        if unknown:
            raise ValueError(f"{type(pipe).__name__} takes no {', '.join(unknown)} (prompt {i}'s sampling params); "
                             f"its call takes: {', '.join(sorted(accepted - {'self'}))}")
        calls.append(call)
    return calls


def _outputs(result: Any, prompt: Any, index: int, params: Any, seed: int | None) -> Any:
    from hsdp.omni.params import OmniRequestOutput

    if hasattr(result, "frames"):
        kind, arrays = "video", result.frames
    else:
        kind, arrays = "image", result.images
    images = [np.asarray(a, dtype=np.float32) for a in arrays]
    metrics: dict[str, Any] = {"seed": seed}
    if params.fps is not None:
        metrics["fps"] = params.fps
    return OmniRequestOutput(request_id=str(index), final_output_type=kind, images=images, prompt=prompt,
                             metrics=metrics)


def _run(world: Any, pipe: Any, request: dict[str, Any]) -> tuple[list[Any], list[str | None]]:
    """Every rank: the request's calls; (outputs on rank 0, each call's error on every rank)."""
    from hsdp.pipelines import generate
    from hsdp.pipelines.lanes import lane_groups, run_lanes

    err: BaseException | None = None
    calls: list[dict[str, Any]] = []
    try:
        calls = _calls(pipe, request)
    except Exception as exc:  # noqa: BLE001 - the same on every rank: the request's outcome
        err = exc
    _agree(world, err, "checking the request")
    groups = lane_groups(pipe)
    if groups is not None:  # data parallel: prompt i on lane i mod D, the lanes in lockstep
        return run_lanes(pipe, calls, world, groups)
    results: list[Any] = []
    errors: list[str | None] = []
    for call in calls:
        err = None
        out = None
        try:
            out = generate(pipe, **call)
        except Exception as exc:  # noqa: BLE001 - a call's failure is its outcome
            err = exc
        try:
            _agree(world, err, "the pipeline call")
            errors.append(None)
        except Exception as exc:  # noqa: BLE001
            errors.append(_error_text(exc))
        results.append(out)
    return results, errors


def main() -> int:
    from multiprocessing.connection import Client

    from hsdp.world import distributed

    world = distributed.init_process_group()
    conn = None
    if world.rank == 0:
        host, _, port = os.environ[ADDRESS_ENV].rpartition(":")
        conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[AUTHKEY_ENV]))
    beat = _beat_seconds()
    pipe = None
    while True:
        message: Any = None
        if world.rank == 0:
            assert conn is not None
            try:
                while not conn.poll(beat):
                    _broadcast(world, ("idle",))  # the others wait inside HSDP_TIMEOUT
                message = conn.recv()
            except (EOFError, OSError):  # the caller closed or died: stop every rank
                message = ("stop",)
        message = _broadcast(world, message)
        op = message[0]
        if op == "idle":
            continue
        if op == "stop":
            break
        if op == "load":
            try:
                pipe = _load(message[1])
                reply: tuple[Any, ...] = ("ready", {"pipeline": type(pipe).__name__, "world_size": world.size})
            except Exception as exc:  # noqa: BLE001 - load_pipeline raises alike on every rank
                reply = ("error", _error_text(exc), traceback.format_exc())
            if conn is not None:
                conn.send(reply)
            if reply[0] == "error":
                break
            continue
        if op == "generate":
            request = message[1]
            try:
                results, errors = _run(world, pipe, request)
                if conn is not None:
                    outputs = [None if e is not None else _outputs(r, p, i, prm, s) for i, (r, e, p, prm, s) in
                               enumerate(zip(results, errors, request["prompts"], request["params"],
                                             request["seeds"], strict=True))]
                    conn.send(("result", outputs, errors))
            except Exception as exc:  # noqa: BLE001 - the request fails; the engine stays up
                if conn is not None:
                    conn.send(("error", _error_text(exc), traceback.format_exc()))
            continue
        raise RuntimeError(f"hsdp.Omni ranks: unknown message {op!r} from the caller")
    if conn is not None:
        conn.close()
    return 0
