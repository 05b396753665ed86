"""``meta_init``: build modules whose parameters have a shape and dtype but no memory.

A rank that will hold only 1/S of a model must never materialise the whole of it, so models
are built under ``meta_init()`` and their weights streamed in (or sharded) afterwards.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

# A ContextVar rather than a global: each thread (and asyncio task) sees its own value, and
# nested ``with`` blocks restore the outer value exactly on exit.
_META_INIT: contextvars.ContextVar[bool] = contextvars.ContextVar("hsdp_meta_init", default=False)


@contextlib.contextmanager
def meta_init(enabled: bool = True) -> Iterator[None]:
    """Within this block, new :class:`~hsdp.nn.Parameter` objects are meta (no data).

    ``meta_init(False)`` switches it off again inside an outer ``meta_init()``.
    """
    token = _META_INIT.set(bool(enabled))
    try:
        yield
    finally:
        _META_INIT.reset(token)


def is_meta_init() -> bool:
    """True inside ``meta_init()`` in the current thread or task."""
    return _META_INIT.get()


__all__ = ["meta_init", "is_meta_init"]
