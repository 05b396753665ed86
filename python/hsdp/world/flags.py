"""On/off ``HSDP_*`` variables: the one rule every flag of hsdp is read by.

Standalone (only the standard library) so that setup.py can load this file by its path for the
build's flags (``HSDP_NO_MPI``, ``HSDP_NO_NCCL``, ``HSDP_WERROR``) before hsdp is built; the C
core's ``hsdp_env_flag`` (csrc/backend.c) reads its flags by the same rule."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

_ON = ("1", "on", "yes", "true")
_OFF = ("0", "off", "no", "false")


def env_flag(name: str, default: bool = False, environ: Mapping[str, str] | None = None) -> bool:
    """An on/off ``HSDP_*`` variable: unset or empty is ``default``; 1/on/yes/true is on and
    0/off/no/false is off, in any case; anything else is ``default``, said in a warning (as the
    C core's ``hsdp_env_flag`` says it on stderr: a flag read inside a collective cannot raise)."""
    env = os.environ if environ is None else environ
    text = env.get(name, "").lower()
    if not text:
        return default
    if text in _ON or text in _OFF:
        return text in _ON
    warnings.warn(f"{name} must be 1/on/yes/true or 0/off/no/false, got {env[name]!r}; using {int(default)}",
                  stacklevel=2)
    return default
