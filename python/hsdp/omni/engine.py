"""``hsdp.Omni``: vllm-omni's offline entry point. From one ordinary Python process it starts
the ranks its ``DiffusionParallelConfig`` needs (``python -m hsdp.launch``, as ``hsdp generate``
starts its own), holds the sharded pipeline in them, and runs each ``generate`` there,
returning the outputs to the caller's process.

[Note: who ends the ranks] The ranks outlive nothing of the caller's: they are a job of
``hsdp.launch`` in a session of its own, and rank 0 holds the one connection to the caller.
``close()`` (also the context manager's exit and ``atexit``) says stop
and waits for the job to end; if the caller dies instead, the connection ends, rank 0 reads
that as stop, and every rank leaves the same way. Either way the launcher ends the job and
removes its ``/dev/shm`` folder (:func:`hsdp.world.launch.end_job`). A job that will not end
is ended by SIGTERM to the launcher, then SIGKILL to it and ``end_job`` here.

The caller's process imports neither torch nor diffusers.
"""

from __future__ import annotations

import atexit
import glob
import os
import random
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

from .params import OmniDiffusionSamplingParams, OmniRequestOutput
from .ranks import ADDRESS_ENV, AUTHKEY_ENV

__all__ = ["OWNER_ENV", "Omni"]

# Every process of an Omni's job carries the caller's pid in this variable (tests find them by it).
OWNER_ENV = "HSDP_OMNI_OWNER"
_ENTRY = Path(__file__).with_name("rank_entry.py")
_DTYPES = ("float32", "bfloat16", "float16")
# How long close() waits for the ranks to stop by themselves, then after SIGTERM.
STOP_WAIT_S = 60.0
TERM_WAIT_S = 20.0


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)} (a name or torch dtype), got {dtype!r}")
    return name


class Omni:
    """``Omni(model=ID_OR_DIR, parallel_config=DiffusionParallelConfig(...), **kwargs)``.

    - ``model``: a diffusers pipeline folder or a hub id (``org/name``, resolved here, once:
      :mod:`hsdp.hub`; ``revision=`` picks the revision).
    - ``parallel_config``: the ranks and modes (None: one rank, nothing sharded).
    - ``dtype`` (or ``torch_dtype``): "bfloat16" (default), "float32", "float16" or the torch dtype.
    - ``device``: None (the CPU) or "cuda" (one GPU per rank).
    - ``shard_text_encoders``: as :func:`hsdp.pipelines.load_pipeline`; ``pipeline_kwargs``: its
      ``from_pretrained`` keywords.

    Starting returns once every rank has loaded the pipeline; a load that fails raises here
    with the ranks' error, and the ranks are gone."""

    def __init__(self, model: str | os.PathLike[str], parallel_config: Any = None, *, dtype: Any = None,
                 torch_dtype: Any = None, device: str | None = None, revision: str | None = None,
                 shard_text_encoders: bool = True, pipeline_kwargs: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        self._closed = True
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._listener: Listener | None = None
        self._lock = threading.Lock()
        if kwargs:
            raise TypeError(f"Omni got unknown keyword(s) {', '.join(sorted(kwargs))}; it takes model, parallel_config, "
                            "dtype (or torch_dtype), device, revision, shard_text_encoders, pipeline_kwargs")
        from hsdp.engine.config import DiffusionParallelConfig
        from hsdp.hub import resolve_model

        if parallel_config is not None and not isinstance(parallel_config, DiffusionParallelConfig):
            raise TypeError(f"parallel_config must be a hsdp.DiffusionParallelConfig or None, got "
                            f"{type(parallel_config).__name__}")
        if torch_dtype is not None and dtype is not None and _dtype_name(torch_dtype) != _dtype_name(dtype):
            raise ValueError(f"Omni got torch_dtype={torch_dtype!r} and dtype={dtype!r}: they name the same setting, give one")
        dtype_name = _dtype_name(dtype if dtype is not None else torch_dtype if torch_dtype is not None else "bfloat16")
        if parallel_config is not None:
            parallel_config.require_supported()
        folder = resolve_model(model, revision, what="model")  # once, here: the ranks get the snapshot
        if not (folder / "model_index.json").is_file():
            raise ValueError(f"model {os.fspath(model)!r}: {folder} is not a diffusers pipeline folder (no "
                             "model_index.json)" if folder.is_dir() else f"model {os.fspath(model)!r}: no such folder")
        self.model = str(folder.resolve())
        self.parallel_config = parallel_config
        self.world_size = parallel_config.world_size if parallel_config is not None else 1
        spec = {"model": self.model, "parallel_config": parallel_config, "dtype": dtype_name, "device": device,
                "shard_text_encoders": shard_text_encoders, "kwargs": dict(pipeline_kwargs or {})}
        self._start(spec)

    # ------------------------------------------------------------------ start-up

    def _start(self, spec: dict[str, Any]) -> None:
        key = secrets.token_bytes(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=key)
        host, port = self._listener.address
        from ..world.job import strip_launcher_env

        env = strip_launcher_env()
        env.update({ADDRESS_ENV: f"{host}:{port}", AUTHKEY_ENV: key.hex(), OWNER_ENV: str(os.getpid())})
        cmd = [sys.executable, "-m", "hsdp.launch", "-n", str(self.world_size), "--", str(_ENTRY)]
        # a session of its own: a Ctrl-C meant for the caller does not kill the ranks mid-call;
        # the caller's exit or death ends them (see the Note)
        self._proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        self._closed = False
        atexit.register(self.close)
        try:
            self._conn = self._accept()
            self._conn.send(("load", spec))
            reply = self._reply("loading the pipeline")
            if reply[0] == "error":
                raise RuntimeError(f"hsdp.Omni: loading {self.model} on {self.world_size} rank(s) failed: {reply[1]}")
            self.info = reply[1]
        except BaseException:
            self.close()
            raise

    def _accept(self) -> Connection:
        """Rank 0's connection; an error if the job ends first."""
        assert self._listener is not None and self._proc is not None
        got: list[Any] = []

        def accept() -> None:
            try:
                got.append(self._listener.accept())  # type: ignore[union-attr]
            except OSError as exc:  # the listener closed: the job ended first
                got.append(exc)

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            if thread.is_alive() and self._proc.poll() is not None:
                self._listener.close()
                thread.join(5)
                raise RuntimeError(f"hsdp.Omni: the ranks ended (exit status {self._proc.returncode}) before rank 0 "
                                   "connected; their output is above")
        if not got or isinstance(got[0], BaseException):
            raise RuntimeError(f"hsdp.Omni: rank 0 did not connect ({got[0] if got else 'no connection'})")
        return got[0]

    def _reply(self, what: str) -> tuple[Any, ...]:
        """The ranks' next message; an error naming ``what`` if the job ends first."""
        assert self._conn is not None and self._proc is not None
        while True:
            try:
                if self._conn.poll(0.2):
                    return self._conn.recv()
            except (EOFError, OSError):
                pass
            else:
                if self._proc.poll() is None:
                    continue
            self._proc.wait()
            raise RuntimeError(f"hsdp.Omni: the ranks ended (exit status {self._proc.returncode}) while {what}; "
                               "their output is above")

    # ------------------------------------------------------------------ generate

    def generate(self, prompts: Any, sampling_params: OmniDiffusionSamplingParams | Sequence[
            OmniDiffusionSamplingParams] | None = None) -> list[OmniRequestOutput]:
        """Runs the prompts on the ranks; one :class:`OmniRequestOutput` per prompt, in order.

        ``prompts``: a string, a dict (``prompt``, ``negative_prompt``,
        ``multi_modal_data={"image": PIL image}``), or a list of those. ``sampling_params``: one
        for every prompt, or a list of one per prompt (default: ``OmniDiffusionSamplingParams()``).
        With data parallel lanes (``data_parallel_size=D``) prompt i runs on lane i mod D, D at
        once. A prompt that fails raises ``RuntimeError`` naming it (after the others ran); the
        engine stays usable."""
        batch = list(prompts) if isinstance(prompts, (list, tuple)) else [prompts]
        if not batch:
            raise ValueError("prompts is an empty list: give at least one prompt")
        for i, p in enumerate(batch):
            if not isinstance(p, str) and not (isinstance(p, dict) and isinstance(p.get("prompt"), str)):
                raise TypeError(f"prompt {i} must be a string or a dict with a 'prompt' string, got {p!r:.80}")
        if sampling_params is None:
            sampling_params = OmniDiffusionSamplingParams()
        if isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
            if len(params) != len(batch):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(batch)} prompts: give one, "
                                 "or one per prompt")
        else:
            params = [sampling_params] * len(batch)
        for i, p in enumerate(params):
            if not isinstance(p, OmniDiffusionSamplingParams):
                raise TypeError(f"sampling_params[{i}] must be an OmniDiffusionSamplingParams, got {type(p).__name__}")
        drawn = random.randrange(2**31)  # a seed left None: one draw per call, the same on every rank
        seeds = [(p.seed if p.seed is not None else drawn) + i for i, p in enumerate(params)]
        with self._lock:
            if self._closed:
                raise RuntimeError("hsdp.Omni: generate() after close()")
            assert self._conn is not None
            self._conn.send(("generate", {"prompts": batch, "params": params, "seeds": seeds}))
            reply = self._reply("generating")
        if reply[0] == "error":
            raise RuntimeError(f"hsdp.Omni: the request failed on the ranks: {reply[1]}")
        _, outputs, errors = reply
        failed = [(i, e) for i, e in enumerate(errors) if e is not None]
        if failed:
            raise RuntimeError("hsdp.Omni: " + "; ".join(f"prompt {i} failed: {e}" for i, e in failed))
        return outputs

    # ------------------------------------------------------------------ teardown

    @property
    def pid(self) -> int | None:
        """The launcher's process id (its job folder is /dev/shm/hsdp-launch.PID.*)."""
        return self._proc.pid if self._proc is not None else None

    def close(self) -> None:
        """Stops the ranks and waits until the job has ended and its files are gone. Safe to
        call more than once; called at interpreter exit for an Omni never closed."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        proc = self._proc
        if self._conn is not None:
            try:
                self._conn.send(("stop",))
            except (OSError, ValueError):
                pass
            self._conn.close()
        if self._listener is not None:
            self._listener.close()
        if proc is None:
            return
        try:
            proc.wait(STOP_WAIT_S)
            return
        except subprocess.TimeoutExpired:
            pass
        proc.send_signal(signal.SIGTERM)  # the launcher forwards it and cleans up
        try:
            proc.wait(TERM_WAIT_S)
            return
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        from hsdp.world.launch import JOB_DIR_PREFIX, end_job, job_base

        for job_dir in glob.glob(os.path.join(job_base(), f"{JOB_DIR_PREFIX}{proc.pid}.*")):
            end_job(job_dir)

    def __enter__(self) -> Omni:  # noqa: PYI034 - Omni is not meant to be subclassed
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
