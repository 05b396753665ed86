"""Checkpoint errors: every message names the file and, where there is one, the tensor.

Messages are built from file content (tensor names, values) that may be hostile, so they
are bounded: a name or value shown in a message is cut to ``MAX_SHOWN_CHARS`` characters
(:func:`shown`), and a whole ``CheckpointError`` message to ``MAX_MESSAGE_CHARS``.
"""

from __future__ import annotations

import os
import reprlib
from typing import Any

MAX_SHOWN_CHARS = 200  # one name or value, as shown in a message
MAX_MESSAGE_CHARS = 2000  # a whole CheckpointError message

# Bounded repr of untrusted values: a few items of a list, a few levels, short strings.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxtuple = 3, 8, 4, 8
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 80, 80, 40


def cut(text: str, limit: int) -> str:
    """``text``, or its start and a note of its length when longer than ``limit``."""
    if len(text) <= limit:
        return text
    note = f"... ({len(text)} characters)"
    return text[: max(0, limit - len(note))] + note


def shown(name: str) -> str:
    """A name from a file as a message shows it: at most MAX_SHOWN_CHARS characters."""
    return cut(name, MAX_SHOWN_CHARS)


def shown_value(value: Any) -> str:
    """repr() of a value from a file, bounded in depth, items and length."""
    return cut(_REPR.repr(value), MAX_SHOWN_CHARS)


class CheckpointError(ValueError):
    """A checkpoint is malformed or does not fit the model. The message is at most
    MAX_MESSAGE_CHARS characters."""

    def __init__(self, *args: object) -> None:
        if args and isinstance(args[0], str):
            args = (cut(args[0], MAX_MESSAGE_CHARS), *args[1:])
        super().__init__(*args)


class CheckpointKeyError(CheckpointError, KeyError):
    """The checkpoint's names and the model's parameter names differ (catchable as either)."""

    def __str__(self) -> str:  # KeyError's str() would repr() the multi-line message
        return str(self.args[0]) if self.args else ""


def in_context(exc: BaseException, where: str) -> BaseException:
    """``exc`` again, with ``where`` (file and tensor) in front of its message.

    Keeps the exception's type for the built-in ones callers catch (OSError for files,
    TypeError for dtypes, ...); anything else becomes a CheckpointError. The message is
    bounded as a CheckpointError's is.
    """
    msg = cut(f"{where}: {exc}", MAX_MESSAGE_CHARS)
    if isinstance(exc, OSError):
        return OSError(exc.errno, msg) if exc.errno is not None else OSError(msg)
    for kind in (CheckpointError, TypeError, ValueError, RuntimeError, MemoryError):
        if isinstance(exc, kind):
            return kind(msg)
    return CheckpointError(msg)


def describe_file(path: str | os.PathLike[str]) -> str:
    return f"checkpoint file '{shown(os.fspath(path))}'"
