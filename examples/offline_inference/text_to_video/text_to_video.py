"""Text to video from a diffusers pipeline folder, its models sharded by HSDP.

What ``hsdp generate`` does, written out with the Python API: load the folder with
``hsdp.pipelines.load_pipeline`` (transformers and text encoders sharded, the rest
replicated), run diffusers' own pipeline call on every rank with ``hsdp.pipelines.generate``
(rank 0 alone decodes), write the video on rank 0, and with ``--verify`` run the stock
unsharded pipeline on rank 0 and compare the frames. The flags are ``hsdp generate``'s, ``--model``
a folder or a hub id;
run from a plain shell the script starts the ranks its flags need itself, through
``hsdp.launch`` (``hsdp.cli.ranks.launch_script``); inside a launched job it runs as its rank.

    python -m hsdp.testing.tiny_pipeline outputs/tiny-wan22 --kind wan22
    python examples/offline_inference/text_to_video/text_to_video.py \\
        --model outputs/tiny-wan22 --prompt "a cat in the snow" --height 32 --width 32 \\
        --num-frames 5 --use-hsdp --hsdp-shard-size 2 --dtype float32 --verify

Exit status: 0 on success, 1 when --verify finds a difference, 2 for bad input.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch

from hsdp import distributed
from hsdp.cli.generate import UsageError, build_parser, call_kwargs, check_args, frames_of
from hsdp.cli.media import write_output
from hsdp.cli.ranks import launch_script
from hsdp.cli.verify import reference_pipeline
from hsdp.pipelines import generate, load_pipeline, pipeline_state


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    parser.prog = "text_to_video.py"
    args = parser.parse_args(argv)
    try:
        folder, config = check_args(args)  # the folder's JSON and the flags, before any weight is read
        if folder.takes_image:
            raise UsageError(f"{folder.class_name} is image-to-video: use image_to_video.py")
    except UsageError as exc:
        parser.error(str(exc))
    started = launch_script(config, __file__, argv, args.model)  # from a plain shell: start the ranks
    if started is not None:
        return started
    dtype = getattr(torch, args.dtype)

    pipe = load_pipeline(args.model, config, torch_dtype=dtype, device=args.device,
                         shard_text_encoders=not args.replicate_text_encoders)
    rank = distributed.get_rank()
    pipe.set_progress_bar_config(disable=rank != 0)
    kwargs = call_kwargs(args, folder)  # prompt, sizes, steps, guidance, output_type="np"
    result = generate(pipe, **kwargs, generator=torch.Generator("cpu").manual_seed(args.seed))

    held = {name: c.local_bytes for name, c in pipeline_state(pipe).components.items()}
    print(f"rank {rank}: holds {sum(held.values())} bytes of weights ({held})", flush=True)
    if rank != 0:
        return 0
    frames = frames_of(result, folder)  # (frames, height, width, 3) in [0, 1]
    write_output(frames, args.output, args.fps or 16)
    print(f"wrote {args.output}: {frames.shape[0]} frames of {frames.shape[2]}x{frames.shape[1]}")
    if not args.verify:
        return 0

    # The stock pipeline from the same folder; in bfloat16 its sharded components store and
    # cast as hsdp does (FSDP2's cast_forward_inputs), so the frames must agree to rounding
    stock = reference_pipeline(args.model, pipe, dtype, args.device)
    stock.set_progress_bar_config(disable=True)
    reference = frames_of(stock(**kwargs, generator=torch.Generator("cpu").manual_seed(args.seed)), folder)
    diff = float(np.max(np.abs(frames - reference)))
    tolerance = args.verify_tolerance
    print(f"verify: max |diff| vs the stock pipeline = {diff:.3g} (tolerance {tolerance:g}): "
          + ("ok" if diff <= tolerance else "MISMATCH"))
    return 0 if diff <= tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
