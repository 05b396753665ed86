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
from typing import Any

__all__ = ["COMPILE_MODES", "TRANSFORMERS", "add_compile_args", "apply_compile_flags", "compile_pipeline",
           "compile_seconds", "on_gpu", "resolve_compile"]

COMPILE_MODES = ("regional", "whole", "none")
TRANSFORMERS = ("transformer", "transformer_2")  # the pipeline components compiled (Wan 2.2's two experts)

log = logging.getLogger("hsdp")


def add_compile_args(parser: argparse.ArgumentParser) -> None:
    """The two flags, on a command's parser (a bad --compile value: argparse's usage error, exit 2)."""
    parser.add_argument(
        "--compile", default=None, choices=COMPILE_MODES, dest="compile",
        help="torch.compile the transformers: regional (each one's compile_repeated_blocks(), diffusers' regional "
        "compile), whole (each one's compile(): the whole forward) or none (eager); default regional on GPUs, "
        "none on CPU ranks. The first request waits for the compile (shown in the report)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run eagerly: the same as --compile none (vllm-omni's flag)")


def resolve_compile(args: argparse.Namespace, on_gpu: bool) -> str:
    """The mode the flags ask for (sets ``args.compile``); ValueError when they contradict."""
    mode = getattr(args, "compile", None)
    if getattr(args, "enforce_eager", False):
        if mode not in (None, "none"):
            raise ValueError(f"--enforce-eager runs eagerly, and --compile {mode} compiles; give one of them")
        mode = "none"
    if mode is None:
        mode = "regional" if on_gpu else "none"
    if mode not in COMPILE_MODES:  # a namespace built by hand, not by the parser
        raise ValueError(f"--compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    args.compile = mode
    return mode


def on_gpu(device: str | None) -> bool:
    """Whether --device puts the ranks on a device rather than host memory (None: the CPU,
    as load_pipeline takes it)."""
    from hsdp.world import devices

    return device is not None and str(device).split(":")[0] != devices.host_framework()


def apply_compile_flags(args: argparse.Namespace) -> str:
    """Both commands' check: :func:`resolve_compile` with the default for ``args.device``."""
    return resolve_compile(args, on_gpu(getattr(args, "device", None)))


def compile_pipeline(pipe: Any, mode: str, **compile_kwargs: Any) -> list[str]:
    """Compile `pipe`'s transformers as `mode` says, in place (nothing runs until the first
    call); returns the names of the components compiled. ``compile_kwargs`` go to
    ``torch.compile`` (``backend=``, say). A transformer without diffusers' ``_repeated_blocks``
    is refused under ``regional``, naming it."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    if mode == "none":
        return []
    names = [n for n in TRANSFORMERS if getattr(pipe, n, None) is not None]
    if mode == "regional":
        for name in names:
            model = getattr(pipe, name)
            if not getattr(model, "_repeated_blocks", None) or not hasattr(model, "compile_repeated_blocks"):
                raise ValueError(
                    f"--compile regional compiles each transformer's repeated blocks, and {name} "
                    f"({type(model).__name__}) names none (diffusers' _repeated_blocks); use --compile whole")
    for name in names:
        model = getattr(pipe, name)
        if mode == "regional":
            model.compile_repeated_blocks(**compile_kwargs)
        else:
            model.compile(**compile_kwargs)
        _announce_first_forward(model, name, mode)
    log.info("compiling %s (%s) at the first call: the first request's first steps wait for it",
             ", ".join(names) or "no transformer", mode)
    return names


def _announce_first_forward(model: Any, name: str, mode: str) -> None:
    """Log the warm-up when `model`'s first forward ends (its compile): the progress a
    server or a generate run shows for the first request. The hooks run eagerly
    (outside_graphs) and stay, doing nothing after the first forward: removing them would
    change the hooks a whole-model graph's guards check, and compile it again."""
    import time

    from hsdp.adapters.torch import outside_graphs

    state: list[float] = []  # [start, compile seconds before]; then [] again with done set
    done: list[bool] = []

    def pre(module: Any, args: Any) -> None:
        if not done and not state:
            state[:] = [time.perf_counter(), compile_seconds() or 0.0]

    def post(module: Any, args: Any, output: Any) -> None:
        if done or not state:
            return
        took, spent = time.perf_counter() - state[0], (compile_seconds() or 0.0) - state[1]
        done.append(True)
        log.info("%s (--compile %s): its first forward took %.2f s, %.2f s of it compiling", name, mode, took, spent)

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
