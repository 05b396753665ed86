"""``--cache``'s text (``hsdp generate``, ``hsdp serve``) as a diffusers step-cache config. Plain
Python until a config is made (diffusers is imported then), so the commands check their flags
before any rank starts without importing torch."""

from __future__ import annotations

import math
from typing import Any

CACHE_KINDS = ("first-block", "taylorseer", "magcache")
# diffusers' default TaylorSeer patterns ("^blocks.*attn", fullmatched) miss Wan's attn1 and attn2:
# the same blocks' attention modules, numbered or not
TAYLORSEER_MODULES = [r"^blocks.*attn\d?", r"^transformer_blocks.*attn\d?", r"^single_transformer_blocks.*attn\d?",
                      r"^temporal_transformer_blocks.*attn\d?"]
CACHE_HELP = ("a step cache on every transformer: first-block:THRESHOLD (diffusers' FirstBlockCacheConfig), "
              "taylorseer[:INTERVAL[:WARMUP[:ORDER]]] (TaylorSeerCacheConfig), or "
              "magcache:THRESHOLD[:RATIOS.json] (MagCacheConfig; Flux has built-in ratios)")


def _number(text: str, what: str, kind: type) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"--cache: {what} must be a {kind.__name__}, got {text!r}") from None
    if value < 0 or (kind is float and not math.isfinite(value)):
        raise ValueError(f"--cache: {what} must be >= 0, got {text!r}")
    return value


def parse_cache(text: str, *, num_inference_steps: int | None = None, model: str = "") -> Any:
    """A diffusers cache config from ``--cache``'s text (see :data:`CACHE_HELP`); ValueError
    naming the part that is wrong."""
    kind, _, rest = text.partition(":")
    parts = rest.split(":") if rest else []
    if kind == "first-block":
        from diffusers import FirstBlockCacheConfig

        if len(parts) != 1:
            raise ValueError(f"--cache first-block takes one threshold (first-block:0.1), got {text!r}")
        return FirstBlockCacheConfig(threshold=_number(parts[0], "first-block's threshold", float))
    if kind == "taylorseer":
        from diffusers import TaylorSeerCacheConfig

        if len(parts) > 3:
            raise ValueError(f"--cache taylorseer takes at most INTERVAL:WARMUP:ORDER, got {text!r}")
        names = ("cache_interval", "disable_cache_before_step", "max_order")
        values = {n: _number(p, f"taylorseer's {n}", int) for n, p in zip(names, parts)}
        if values.get("cache_interval", 1) < 1:
            raise ValueError(f"--cache taylorseer: the interval must be >= 1, got {parts[0]!r}")
        return TaylorSeerCacheConfig(**values, cache_identifiers=list(TAYLORSEER_MODULES))
    if kind == "magcache":
        from diffusers import MagCacheConfig

        if not 1 <= len(parts) <= 2:
            raise ValueError(f"--cache magcache takes THRESHOLD[:RATIOS.json], got {text!r}")
        threshold = _number(parts[0], "magcache's threshold", float)
        if len(parts) == 2:
            import json
            from pathlib import Path

            try:
                ratios = json.loads(Path(parts[1]).read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"--cache magcache: cannot read the ratios file {parts[1]}: {exc}") from None
            if not isinstance(ratios, list) or not ratios or not all(isinstance(r, (int, float)) for r in ratios):
                raise ValueError(f"--cache magcache: {parts[1]} must hold a JSON list of numbers (the ratios)")
        elif model.startswith("Flux"):
            from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

            ratios = FLUX_MAG_RATIOS
        else:
            raise ValueError(f"--cache magcache needs the model's ratios (magcache:THRESHOLD:RATIOS.json, from a "
                             f"calibration run); diffusers ships them for Flux only, not for {model or 'this model'}")
        steps = num_inference_steps or 28
        return MagCacheConfig(threshold=threshold, num_inference_steps=steps, mag_ratios=ratios)
    raise ValueError(f"--cache {text!r}: the kind must be one of {', '.join(CACHE_KINDS)}")
