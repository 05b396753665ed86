"""``hsdp serve``: load a pipeline folder sharded across ranks and serve it over HTTP.

    hsdp serve --model DIR --use-hsdp --hsdp-shard-size 2 [--host 127.0.0.1] [--port 8091] [--api-key KEY]

The number of ranks follows from the parallel flags, as for ``hsdp generate``: run from a
plain shell, the command starts them itself through :mod:`hsdp.launch`'s job runner; inside
a job that ``mpiexec``, ``hsdp.launch`` or ``torchrun`` started, it runs as the rank it is.

Shutdown: SIGTERM to the command stops rank 0 accepting (new jobs get 503), gives the running
job ``--shutdown-grace`` seconds and then cancels it, fails the queued ones (with
``--state-dir``: leaves them queued for the next start), tells every rank to stop, closes the
HTTP server, and every rank exits 0. The command started its mpiexec in a session of its own
and sends the signal to rank 0 alone: Open MPI's mpiexec, signalled itself, kills its ranks at
once. A second SIGTERM, or SIGINT (Ctrl-C), ends the job at once; the command then removes the
temporary files it made (the pid file, the temporary output folder).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from hsdp.cli.base import UsageError, add_load_args, command_main, start_rank
from hsdp.cli.cache_spec import CACHE_HELP
from hsdp.cli.compile_mode import apply_compile_flags, check_compile_folder
from hsdp.cli.folder import FolderError, PipelineFolder, read_folder
from hsdp.engine.config import DiffusionParallelConfig

__all__ = ["CONTROL_ENV", "UsageError", "build_parser", "main"]

PROG = "hsdp serve"
# Set by the self-launching command for its ranks: the file rank 0 writes its pid into, so the
# command can signal rank 0 alone.
CONTROL_ENV = "HSDP_SERVE_CONTROL"
# Set by the self-launching command: the temporary output folder it made for rank 0 and removes
# once the ranks have ended, however they ended (mpiexec's kill of a rank included).
TEMP_ENV = "HSDP_SERVE_TEMP_DIR"

log = logging.getLogger("hsdp.serve")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Serve a diffusers pipeline folder, its transformers and text encoders sharded across ranks, "
        "behind vllm-omni's Videos API (POST /v1/videos, ...) or OpenAI's images API (image models). The ranks "
        "the parallel flags need are started through mpiexec unless this already runs inside one rank of a job.",
        epilog="example: hsdp serve --model tiny-wan22 --use-hsdp --hsdp-shard-size 2 --port 8091",
    )
    # vllm serve's shape: the model may come first, without --model (main() moves it there)
    p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="the same as --model, as in `vllm serve MODEL`")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id in /v1/models and requests (default: the folder's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8091, help="port to listen on (default: %(default)s; 0: any free)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $HSDP_API_KEY)")
    p.add_argument("--output-dir", type=Path, default=None, metavar="DIR",
                   help="where finished videos are written and kept (after exit too); default: a temporary "
                   "folder of this server, removed when it stops")
    p.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="jobs that may wait; beyond, requests get 429 (default: %(default)s)")
    p.add_argument("--cache", action="append", default=None, metavar="KIND[:ARGS]",
                   help=CACHE_HELP + ". Repeat it to allow several: the first is every job's default, and a "
                   "request picks another (or none) with extra_params={\"cache\": \"...\"}; --cache none first: no cache by "
                   "default")
    p.add_argument("--omni", action="store_true",
                   help="accepted for vllm-omni's command lines and ignored: hsdp serve always serves one diffusion "
                   "pipeline")
    p.add_argument("--max-pixels", type=int, default=None, metavar="N",
                   help="largest width x height a request may ask (400 beyond); a request without a size gets the "
                   "model's default scaled down to it")
    p.add_argument("--max-frames", type=int, default=None, metavar="N",
                   help="most frames a request may ask (400 beyond); caps the model's default too")
    p.add_argument("--max-steps", type=int, default=None, metavar="N",
                   help="most denoising steps a request may ask (400 beyond); caps the model's default too")
    p.add_argument("--max-prompt-chars", type=int, default=10000, metavar="N",
                   help="longest prompt (and negative prompt) taken, in characters (default: %(default)s)")
    p.add_argument("--state-dir", type=Path, default=None, metavar="DIR",
                   help="keep jobs (SQLite) and videos here: a restart lists and serves the finished jobs and runs "
                   "the queued ones; a job running when the server died is marked failed")
    p.add_argument("--job-ttl", type=float, default=3600.0, metavar="SECONDS",
                   help="finished jobs and their videos are removed this long after they ended (default: "
                   "%(default)s; 0: kept)")
    p.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
                   help="after SIGTERM, how long the running job may take before it is cancelled (default: "
                   "%(default)s); a second SIGTERM, or SIGINT, ends the server at once")
    add_load_args(p, model_required=False)  # MODEL or --model: check_args says which is missing
    return p


SERVE_MODULES = {"fastapi": "fastapi", "uvicorn": "uvicorn", "multipart": "python-multipart",
                 "prometheus_client": "prometheus_client"}


def check_extra() -> None:
    """The [serve] extra's packages are installed, else one line saying how (every rank would
    otherwise die on the import with a traceback)."""
    import importlib.util

    missing = [pkg for mod, pkg in SERVE_MODULES.items() if importlib.util.find_spec(mod) is None]
    if missing:
        raise UsageError(f"the HTTP server needs the [serve] extra: pip install 'hsdp[serve]' (missing: "
                         f"{', '.join(missing)})")


def check_args(args: argparse.Namespace) -> tuple[PipelineFolder, DiffusionParallelConfig]:
    from hsdp.hub import HubError, is_hub_id, resolve_model_flag

    if args.model_arg is not None:  # main() moves it to --model; here when called with a parsed line
        if args.model is not None and Path(args.model_arg) != args.model:
            raise UsageError(f"the model is given twice: MODEL {args.model_arg} and --model {args.model}")
        args.model = Path(args.model_arg)
    if args.model is None:
        raise UsageError("the model is required: hsdp serve MODEL or --model DIR")
    check_extra()
    for flag in ("max_pixels", "max_frames", "max_steps", "max_prompt_chars"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    for flag in ("job_ttl", "shutdown_grace"):
        if getattr(args, flag) < 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    if args.state_dir is not None and args.state_dir.exists() and not args.state_dir.is_dir():
        raise UsageError(f"--state-dir {args.state_dir} exists and is not a folder")

    if args.served_model_name is None and is_hub_id(args.model):  # served as the id, not the snapshot's commit
        args.served_model_name = str(args.model)
    try:  # a hub id (org/name): its cached snapshot (hsdp.hub)
        args.model = resolve_model_flag(args.model, getattr(args, "revision", None))
        folder = read_folder(args.model)
    except (FolderError, HubError) as exc:
        raise UsageError(str(exc)) from None
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 1:
        raise UsageError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.api_key is None:
        args.api_key = os.environ.get("HSDP_API_KEY") or None
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("--api-key is empty")
    if args.output_dir is not None and args.output_dir.exists() and not args.output_dir.is_dir():
        raise UsageError(f"--output-dir {args.output_dir} exists and is not a folder")
    try:
        config = DiffusionParallelConfig.from_cli_args(args)
        config.require_supported()
    except (ValueError, NotImplementedError) as exc:
        raise UsageError(str(exc)) from None
    try:
        check_compile_folder(apply_compile_flags(args), folder)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    args.caches = tuple(dict.fromkeys(args.cache or ()))
    if args.caches:
        from hsdp.cli.cache_spec import parse_cache

        for spec in args.caches:
            if spec == "none":  # allowed: a job without a cache (first: the default)
                continue
            try:
                parse_cache(spec, model=folder.class_name)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
    return folder, config


# ----------------------------------------------------------------------------- starting the ranks


def launch_ranks(nproc: int, argv: Sequence[str]) -> int:
    """Runs ``python -m hsdp serve ARGV`` on ``nproc`` ranks (hsdp.cli.ranks.launch_self, in a
    session of its own); its exit status. The first SIGTERM goes to rank 0 alone, which stops
    the server gracefully; SIGINT, or a second signal, ends the job at once."""
    from hsdp.cli.ranks import launch_self

    fd, control = tempfile.mkstemp(prefix="hsdp-serve-", suffix=".pid")
    os.close(fd)
    added = {CONTROL_ENV: control}
    if "--output-dir" not in argv and not any(a.startswith("--output-dir=") for a in argv) \
            and "--state-dir" not in argv and not any(a.startswith("--state-dir=") for a in argv):
        added[TEMP_ENV] = tempfile.mkdtemp(prefix="hsdp-serve-")

    def to_rank0(signum: int, proc: subprocess.Popen[bytes], count: int) -> bool:
        if proc.poll() is not None:
            return True
        try:
            text = Path(control).read_text().strip()
        except OSError:
            text = ""
        if count == 1 and signum == signal.SIGTERM and text.isdigit():
            os.kill(int(text), signal.SIGTERM)  # rank 0 stops the server and then every rank
            return True
        return False  # SIGINT, not started yet, or asked twice: mpiexec ends the job now

    try:  # a session of its own: a terminal's Ctrl-C reaches this command only, not mpiexec
        return launch_self(nproc, ["serve", *argv], env=added, on_signal=to_rank0, new_session=True)
    finally:
        Path(control).unlink(missing_ok=True)
        if TEMP_ENV in added:  # rank 0 removes it itself when it can; a killed rank cannot
            shutil.rmtree(added[TEMP_ENV], ignore_errors=True)


# ----------------------------------------------------------------------------- one rank


class _Shutdown:
    """SIGTERM on rank 0: stop accepting; the running job gets ``grace`` seconds, then is
    cancelled, and the job loop ends. A second SIGTERM, or SIGINT, ends the server at once
    (the temporary folder removed first). On the other ranks: ignored, rank 0 says when to stop."""

    def __init__(self, rank: int, grace: float = 30.0) -> None:
        self.rank = rank
        self.grace = grace
        self.count = 0
        self.on_stop: list[Any] = []
        self.on_grace_end: list[Any] = []
        self.temporary: Path | None = None  # removed before an immediate exit

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        self.count += 1
        if self.rank != 0:
            return
        if self.count > 1 or signum == signal.SIGINT:
            sys.stderr.write(f"{PROG}: {'second ' if self.count > 1 else ''}{signal.Signals(signum).name}: ending "
                             "every rank now\n")
            sys.stderr.flush()
            if self.temporary is not None:
                shutil.rmtree(self.temporary, ignore_errors=True)
            os._exit(128 + signum)
        sys.stderr.write(f"{PROG}: {signal.Signals(signum).name}: no new jobs; the running job has "
                         f"{self.grace:g} s (--shutdown-grace) to end, then is cancelled\n")
        sys.stderr.flush()
        for callback in self.on_stop:
            callback()
        timer = threading.Timer(self.grace, self._grace_over)
        timer.daemon = True
        timer.start()

    def _grace_over(self) -> None:
        for callback in self.on_grace_end:
            callback()


def _start_http(app: Any, host: str, port: int) -> tuple[Any, threading.Thread]:
    """uvicorn in a thread (it leaves signals to the main thread there); returns once it
    listens, or raises naming why it could not."""
    import uvicorn

    # At shutdown, requests still open get this long to be answered (the jobs have ended by then).
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=30)
    server = uvicorn.Server(config)

    def serve() -> None:
        try:
            server.run()
        except SystemExit:  # uvicorn's way of saying it could not start; its log said why
            pass

    thread = threading.Thread(target=serve, name="hsdp-serve-http", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"{PROG}: the HTTP server could not listen on {host}:{port} (see uvicorn's message "
                               "above; is the port in use?)")
        thread.join(0.05)
    return server, thread


def _bound_port(server: Any) -> int:
    for s in getattr(server, "servers", []):
        for sock in getattr(s, "sockets", []):
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                return int(sock.getsockname()[1])
    return -1


def run(args: argparse.Namespace, folder: PipelineFolder, config: DiffusionParallelConfig) -> int:
    world = start_rank(args, config)  # the backend --device needs, as load_pipeline picks it
    rank0 = world.rank == 0
    shutdown = _Shutdown(world.rank, args.shutdown_grace)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, shutdown)

    import torch

    from hsdp.cli.compile_mode import compile_pipeline
    from hsdp.pipelines import load_pipeline

    from .worker import follower_loop, leader_loop

    if not rank0:
        pipe = load_pipeline(folder.path, config, torch_dtype=getattr(torch, args.dtype), device=args.device,
                             shard_text_encoders=not args.replicate_text_encoders, progress=False)
        pipe.set_progress_bar_config(disable=True)
        compile_pipeline(pipe, args.compile)  # compiles in the first job (hsdp.cli.compile_mode)
        follower_loop(world, pipe)
        return 0

    from .app import create_app
    from .jobs import JobStore
    from .metrics import ServeMetrics
    from .params import Limits
    from .worker import LeaderSettings

    control = os.environ.get(CONTROL_ENV)
    if control:
        Path(control).write_text(str(os.getpid()))
    if args.omni:
        print(f"{PROG}: --omni is accepted for vllm-omni's command lines and ignored (this server runs one "
              "diffusion pipeline)", flush=True)
    model_id = args.served_model_name or folder.path.resolve().name
    state = None
    if args.state_dir is not None:
        from .state import StateDir

        state = StateDir(args.state_dir)
    store = JobStore(model_id, args.max_queue, ttl=args.job_ttl, state=state)
    restored = store.restore()
    metrics = ServeMetrics(store, model_id)
    limits = Limits(args.max_pixels, args.max_frames, args.max_steps, args.max_prompt_chars)
    ready = threading.Event()
    temporary = args.output_dir is None and state is None
    if state is not None:
        output_dir = args.output_dir or state.outputs
    elif temporary:  # the launching command's, or one of this rank's own
        output_dir = Path(os.environ.get(TEMP_ENV) or tempfile.mkdtemp(prefix="hsdp-serve-"))
    else:
        output_dir = args.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    if temporary:
        shutdown.temporary = output_dir
    try:
        app = create_app(store, folder, model_id, ready, args.api_key, cfg_parallel=config.cfg_parallel_size == 2,
                         caches=args.caches, limits=limits, metrics=metrics)
        server, thread = _start_http(app, args.host, args.port)
        if state is not None:
            print(f"{PROG}: state in {args.state_dir}: {restored[0]} finished job(s) kept, {restored[1]} queued "
                  f"job(s) to run, {restored[2]} that was running marked failed", flush=True)

        # A signal stops new jobs (503) at once; the HTTP server stays up, answering status
        # requests and the running job's waiting client, until the job loop has ended.
        shutdown.on_stop.append(store.stop_accepting)
        shutdown.on_grace_end.append(lambda: store.cancel_running(
            f"cancelled: the server stopped (--shutdown-grace {args.shutdown_grace:g} s passed)"))
        if shutdown.count:  # a signal came before the server existed
            store.stop_accepting()
        print(f"{PROG}: listening on http://{args.host}:{_bound_port(server)} (loading {folder.class_name} from "
              f"{folder.path} on {world.size} rank(s): {config.describe()})", flush=True)
        pipe = load_pipeline(folder.path, config, torch_dtype=getattr(torch, args.dtype), device=args.device,
                             shard_text_encoders=not args.replicate_text_encoders, progress=True)
        pipe.set_progress_bar_config(disable=True)
        compile_pipeline(pipe, args.compile)  # the first job's first forward logs its warm-up
        ready.set()
        print(f"{PROG}: ready: {model_id} ({folder.class_name}); outputs in {output_dir}"
              f"{' (removed at exit)' if temporary else ''}; rank 0 is pid {os.getpid()} (SIGTERM it to stop)",
              flush=True)
        ran = leader_loop(world, pipe, store, LeaderSettings(output_dir, limits, folder))
        server.should_exit = True  # closes the listening socket; open requests are answered
        thread.join()
        print(f"{PROG}: stopped after {ran} job(s)", flush=True)
    finally:
        if temporary:
            shutil.rmtree(output_dir, ignore_errors=True)
        if state is not None:
            state.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``hsdp serve ARGS``; returns the exit status."""
    argv = _model_first(list(sys.argv[1:] if argv is None else argv))
    return command_main(PROG, argv, build_parser(), check_args, run, launch_ranks)


def _model_first(argv: list[str]) -> list[str]:
    """``hsdp serve MODEL ...`` (vllm's shape) as ``hsdp serve --model MODEL ...``: the ranks and
    the hub's pinning then see one spelling."""
    parser = build_parser()
    try:
        known, _ = parser.parse_known_args(argv)
    except SystemExit:  # argparse's message comes again when command_main parses
        return argv
    if known.model_arg is None or known.model is not None:
        return argv  # none, or both (check_args names the clash)
    takes_value = {opt for action in parser._actions for opt in action.option_strings if action.nargs != 0}
    for i, arg in enumerate(argv):
        if arg == known.model_arg and not (i and argv[i - 1] in takes_value):
            return ["--model", arg, *argv[:i], *argv[i + 1:]]
    return argv
