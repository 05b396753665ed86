"""``--compile {regional,whole,none}`` and ``--enforce-eager`` (``hsdp generate``, ``hsdp serve``):
what torch.compile does to a loaded pipeline's transformers.

- ``regional``: each transformer's ``compile_repeated_blocks()`` (diffusers' regional compile:
  one graph per block class, shared by every block; what the docs recommend).
- ``whole``: each transformer's ``compile()`` (torch's ``nn.Module.compile``: the model's whole
  forward, in place, so the pipeline keeps its component objects).
- ``none``: eager. ``--enforce-eager`` is vllm-omni's spelling of it.

The default is ``regional`` on GPUs (as vllm-omni's runner compiles ``transformer`` and
``transformer_2``; UNTESTED ON A GPU) and ``none`` on CPU ranks (bench/bench_compile.py:
docs/performance.md, "torch.compile"). hsdp's hooks stay out of the graphs either way
([Note: compile] in :mod:`hsdp.adapters.torch`).

Plain Python until :func:`compile_pipeline` runs (torch is imported then), so the commands
check their flags before any rank starts.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["COMPILE_MODES", "TRANSFORMERS", "CompileWatch", "add_compile_args", "apply_compile_flags",
           "check_compile_folder", "check_mode", "compile_pipeline", "compile_seconds", "compile_watch", "on_gpu",
           "resolve_compile"]

COMPILE_MODES = ("regional", "whole", "none")
TRANSFORMERS = ("transformer", "transformer_2")  # the pipeline components compiled (Wan 2.2's two experts)

log = logging.getLogger("hsdp")


def add_compile_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The two flags, on a command's parser (a bad --compile value: argparse's usage error, exit 2)."""
    parser.add_argument(
        "--compile", default=None, choices=COMPILE_MODES, dest="compile",
        help="torch.compile the transformers: regional (each one's compile_repeated_blocks(), diffusers' regional "
        "compile), whole (each one's compile(): the whole forward) or none (eager); default regional on GPUs, "
        "none on CPU ranks. The first request waits for the compile (shown in the report)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run eagerly: the same as --compile none (vllm-omni's flag)")


def check_mode(mode: object, what: str = "--compile") -> str:
    """The one rule for a compile mode's value (the commands' flag, :func:`compile_pipeline`'s
    argument, :func:`check_compile_folder`'s): one of :data:`COMPILE_MODES`; ValueError naming
    ``what`` otherwise."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"{what} must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    return str(mode)


def _no_repeated_blocks(name: str, class_name: str) -> str:
    """The refusal of ``regional`` for a transformer class without repeated blocks (one wording
    for the folder check and the loaded pipeline's)."""
    return (f"--compile regional compiles each transformer's repeated blocks, and {name} ({class_name}) names none "
            f"(diffusers' _repeated_blocks); use --compile whole")


def resolve_compile(args: argparse.Namespace, on_gpu: bool) -> str:
    """The mode the flags ask for (sets ``args.compile``); ValueError when they contradict."""
    mode = getattr(args, "compile", None)
    if getattr(args, "enforce_eager", False):
        if mode not in (None, "none"):
            raise ValueError(f"--enforce-eager runs eagerly, and --compile {mode} compiles; give one of them")
        mode = "none"
    if mode is None:
        mode = "regional" if on_gpu else "none"
    args.compile = check_mode(mode)  # a namespace built by hand, not by the parser, may hold anything
    return mode


def on_gpu(device: str | None) -> bool:
    """Whether --device puts the ranks on a device rather than host memory (None: the CPU,
    as load_pipeline takes it)."""
    from hsdp.world import devices

    return device is not None and str(device).split(":")[0] != devices.host_framework()


def apply_compile_flags(args: argparse.Namespace) -> str:
    """Both commands' check: :func:`resolve_compile` with the default for ``args.device``."""
    return resolve_compile(args, on_gpu(getattr(args, "device", None)))


def check_compile_folder(mode: str, folder: Any) -> None:
    """The check :func:`compile_pipeline` makes, from the folder alone (no weights, no torch
    until needed), so that a command refuses ``--compile regional`` before any rank loads:
    ValueError naming the transformer and its class when ``mode`` is ``regional`` and a
    transformer the folder lists is a diffusers class without ``_repeated_blocks``. ``folder``
    is a :class:`hsdp.cli.folder.PipelineFolder` (its ``transformers``, read from
    model_index.json). A class diffusers does not have is left to the loader, which names it."""
    check_mode(mode)
    if mode != "regional":
        return
    for name, library, class_name in folder.transformers:
        if library != "diffusers":
            continue
        import diffusers  # only here: the other modes, and folders without transformers, need no import

        cls = getattr(diffusers, class_name, None)
        if cls is not None and not getattr(cls, "_repeated_blocks", None):
            raise ValueError(_no_repeated_blocks(name, class_name))


@dataclass
class CompileWatch:
    """A compiled pipeline's warm-up as it happens (:func:`compile_watch`): each compiled
    transformer's first forward is its compile. ``listeners`` are called ``(name, started)`` at
    the start and the end of each such forward (the server's job record shows it:
    :mod:`hsdp.serve.worker`)."""

    mode: str
    transformers: list[str]
    running: str | None = None  # the transformer whose first forward (its compile) runs now
    warmed: dict[str, dict[str, float]] = field(default_factory=dict)  # name -> first forward's seconds
    listeners: list[Callable[[str, bool], None]] = field(default_factory=list)

    def _tell(self, name: str, started: bool) -> None:
        for listener in self.listeners:
            listener(name, started)


def compile_watch(pipe: Any) -> CompileWatch | None:
    """The warm-up watch :func:`compile_pipeline` left on `pipe` (None: not compiled)."""
    watch = getattr(pipe, "_hsdp_compile", None)
    return watch if isinstance(watch, CompileWatch) else None


def compile_pipeline(pipe: Any, mode: str, **compile_kwargs: Any) -> list[str]:
    """Compile `pipe`'s transformers as `mode` says, in place (nothing runs until the first
    call); returns the names of the components compiled. ``compile_kwargs`` go to
    ``torch.compile`` (``backend=``, say). A transformer without diffusers' ``_repeated_blocks``
    is refused under ``regional``, naming it."""
    check_mode(mode, "compile mode")  # library callers pass anything; the commands checked already
    if mode == "none":
        return []
    names = [n for n in TRANSFORMERS if getattr(pipe, n, None) is not None]
    if mode == "regional":
        for name in names:
            model = getattr(pipe, name)
            if not getattr(model, "_repeated_blocks", None) or not hasattr(model, "compile_repeated_blocks"):
                raise ValueError(_no_repeated_blocks(name, type(model).__name__))
    watch = CompileWatch(mode, names)
    for name in names:
        model = getattr(pipe, name)
        if mode == "regional":
            model.compile_repeated_blocks(**compile_kwargs)
        else:
            model.compile(**compile_kwargs)
        _announce_first_forward(model, name, watch)
    object.__setattr__(pipe, "_hsdp_compile", watch)  # not a pipeline component: past diffusers' __setattr__
    log.info("compiling %s (%s) at the first call: the first request's first steps wait for it",
             ", ".join(names) or "no transformer", mode)
    return names


def _announce_first_forward(model: Any, name: str, watch: CompileWatch) -> None:
    """Tell `watch` when `model`'s first forward (its compile) starts and ends, and log the
    warm-up at its end: the progress a server or a generate run shows for the first request
    (a server's job record too). The hooks run eagerly
    (outside_graphs) and stay, doing nothing after the first forward: removing them would
    change the hooks a whole-model graph's guards check, and compile it again."""
    import time

    from hsdp.adapters.torch import outside_graphs

    state: list[float] = []  # [start, compile seconds before]; then [] again with done set
    done: list[bool] = []

    def pre(module: Any, args: Any) -> None:
        if not done and not state:
            state[:] = [time.perf_counter(), compile_seconds() or 0.0]
            watch.running = name
            watch._tell(name, True)

    def post(module: Any, args: Any, output: Any) -> None:
        if done or not state:
            return
        took, spent = time.perf_counter() - state[0], (compile_seconds() or 0.0) - state[1]
        done.append(True)
        watch.warmed[name] = {"first_forward_seconds": round(took, 3), "compile_seconds": round(spent, 3)}
        watch.running = None
        watch._tell(name, False)
        log.info("%s (--compile %s): its first forward took %.2f s, %.2f s of it compiling", name, watch.mode, took,
                 spent)

    model.register_forward_pre_hook(outside_graphs(pre))
    model.register_forward_hook(outside_graphs(post))


def compile_seconds() -> float | None:
    """Seconds this process has spent compiling so far, as torch's Dynamo counts them (its
    frames' compile_inner, which includes the backend's); None where this torch keeps no such count."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return None
    times = [sum(v) for k, v in compilation_time_metrics.items() if k.endswith("compile_inner")]
    return sum(times) if times else None
