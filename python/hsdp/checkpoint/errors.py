"""Checkpoint errors: every message names the file and, where there is one, the tensor."""

from __future__ import annotations

import os


class CheckpointError(ValueError):
    """A checkpoint is malformed or does not fit the model."""


class CheckpointKeyError(CheckpointError, KeyError):
    """The checkpoint's names and the model's parameter names differ (catchable as either)."""

    def __str__(self) -> str:  # KeyError's str() would repr() the multi-line message
        return str(self.args[0]) if self.args else ""


def in_context(exc: BaseException, where: str) -> BaseException:
    """``exc`` again, with ``where`` (file and tensor) in front of its message.

    Keeps the exception's type for the built-in ones callers catch (OSError for files,
    TypeError for dtypes, ...); anything else becomes a CheckpointError.
    """
    msg = f"{where}: {exc}"
    if isinstance(exc, OSError):
        return OSError(exc.errno, msg) if exc.errno is not None else OSError(msg)
    for kind in (CheckpointError, TypeError, ValueError, RuntimeError, MemoryError):
        if isinstance(exc, kind):
            return kind(msg)
    return CheckpointError(msg)


def describe_file(path: str | os.PathLike[str]) -> str:
    return f"checkpoint file '{os.fspath(path)}'"
