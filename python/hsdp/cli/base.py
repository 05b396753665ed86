"""What ``hsdp generate`` and ``hsdp serve`` share, decided here once: the flags that say what
is loaded and how (the model, its revision, dtype, device, text encoders, compile and the
parallel flags), the usage error and how it is said, the command's entry (parse, check,
then start the ranks or run as one), and a rank's first steps (its world, checked against the
flags, and its logging).

Plain Python: the commands check their flags before torch is imported or any rank starts.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hsdp.cli.compile_mode import add_compile_args
from hsdp.engine.config import add_parallel_args

__all__ = ["DTYPES", "EXIT_USAGE", "UsageError", "add_load_args", "command_main", "start_rank", "usage_error"]

EXIT_USAGE = 2
DTYPES = ("bfloat16", "float32", "float16")


class UsageError(ValueError):
    """Bad input, found before any heavy work; the message names what is wrong (exit 2)."""


def add_load_args(p: argparse.ArgumentParser, *, model_required: bool) -> None:
    """The flags both commands load a pipeline folder with, compile it and split it by, in
    groups of their own (after each command's own flags in --help)."""
    g = p.add_argument_group("model", "What is loaded, and how")
    g.add_argument("--model", type=Path, required=model_required, default=None, metavar="DIR",
                   help="a diffusers pipeline folder (model_index.json; save_pretrained's layout), or a Hugging "
                   "Face hub id (org/name) resolved from the local cache (downloaded unless HF_HUB_OFFLINE is set)")
    g.add_argument("--revision", default=None, metavar="REV",
                   help="the hub branch, tag or commit of a hub id --model (default: main)")
    g.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                   help="torch_dtype of the pipeline, and of the shards (default: %(default)s)")
    g.add_argument("--device", default=None,
                   help="cpu (default) or cuda: one GPU per rank, the NCCL backend")
    g.add_argument("--replicate-text-encoders", action="store_true",
                   help="keep whole text encoders on every rank instead of sharding them")
    add_compile_args(p.add_argument_group("compile", "torch.compile of the transformers"))
    add_parallel_args(p)


def usage_error(prog: str, message: str, status: int = EXIT_USAGE) -> int:
    """Says a usage error on stderr, prefixed with this rank's label inside a job: every rank
    reaches the same verdict from the same flags and each says it, so a rank whose view
    differs (a folder missing on one host) does not fail silently. Returns `status`."""
    from hsdp.world._rank import rank_label

    label = rank_label()
    prefix = "" if label == "rank ?" else f"[{label}] "
    sys.stderr.write(f"{prefix}{prog}: error: {message}\n")
    sys.stderr.flush()
    return status


def command_main(prog: str, argv: Sequence[str] | None, parser: argparse.ArgumentParser,
                 check: Callable[[argparse.Namespace], tuple[Any, ...]], run: Callable[..., int],
                 launch: Callable[[int, list[str]], int]) -> int:
    """One command's entry: parse (argparse's usage errors exit 2, --help 0), check the
    flags (UsageError: exit 2 on every rank), then either start the world size's ranks
    (`launch(n, argv)`, from a plain shell: :func:`hsdp.cli.ranks.launch_self`) or run as the
    rank this is (`run(args, *checked)`, which may raise UsageError too: a job of the wrong
    size, a folder whose weights fail the loader's checks)."""
    from hsdp.cli.ranks import inside_launched_job
    from hsdp.world.launch import LaunchError

    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        checked = check(args)
    except UsageError as exc:
        return usage_error(prog, str(exc))
    config = checked[-1]
    if config.world_size > 1 and not inside_launched_job():
        if getattr(args, "model", None) is not None:  # the ranks load the snapshot resolved here (hsdp.hub)
            from hsdp.hub import pin_model_argv

            args_list = pin_model_argv(args_list, args.model, getattr(args, "served_model_name", None))
        sys.stderr.write(f"{prog}: starting {config.world_size} ranks ({config.describe()}) with hsdp.launch\n")
        sys.stderr.flush()
        try:
            return launch(config.world_size, args_list)
        except LaunchError as exc:
            return usage_error(prog, str(exc), exc.status)
    try:
        return run(args, *checked)
    except UsageError as exc:
        return usage_error(prog, str(exc))


def start_rank(args: argparse.Namespace, config: Any) -> Any:
    """A rank's first steps, before torch is imported: the world ``--device`` needs (NCCL for
    cuda, even under mpiexec; what load_pipeline picks), checked against the flags' world size
    (a job of the wrong size costs nothing: UsageError), and logging (INFO on rank 0, warnings
    elsewhere). Returns the world."""
    from hsdp.world import distributed

    world = distributed.world_for_device(args.device, f"--device {args.device}")
    try:
        config.check_world(world.size)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    logging.basicConfig(level=logging.INFO if world.rank == 0 else logging.WARNING, format="%(name)s: %(message)s")
    return world
