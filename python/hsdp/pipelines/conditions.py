"""Which submodules of a pipeline's model become HSDP units: a small registry by model class.

A model class is looked up, most specific first along its MRO, by class object and then by
class name; a class may instead carry its own ``_hsdp_shard_conditions`` (a list of
callables ``(name, module) -> bool``, as ``hsdp.apply_hsdp_to_model`` takes). Built in:

============================================  =============================================
class                                         units
============================================  =============================================
diffusers ``WanTransformer3DModel``           ``blocks.<i>``
diffusers ``FluxTransformer2DModel``          ``transformer_blocks.<i>``, ``single_transformer_blocks.<i>``
diffusers ``LTXVideoTransformer3DModel``, ``QwenImageTransformer2DModel``  ``transformer_blocks.<i>``
transformers ``T5EncoderModel``, ``UMT5EncoderModel``  ``encoder.block.<i>``
transformers ``CLIPTextModel``, ``CLIPTextModelWithProjection``  ``text_model.encoder.layers.<i>`` (4.x),
                                              ``encoder.layers.<i>`` (5.x)
============================================  =============================================

A condition given as a string is a module path in which ``<i>`` stands for any index
(``"blocks.<i>"`` selects ``blocks.0``, ``blocks.1``, ... and nothing below them). Whole
blocks keep every sublayer a model keeps in float32 (``_keep_in_fp32_modules``) inside a
unit with the rest of its block, which hsdp stores in each parameter's own dtype.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

ShardCondition = Callable[[str, Any], bool]
ConditionSpec = str | ShardCondition

_REGISTRY: dict[Any, tuple[ShardCondition, ...]] = {}


class _PathCondition:
    """A module path with ``<i>`` for any index, as a shard condition (readable in errors)."""

    def __init__(self, pattern: str) -> None:
        if not pattern or pattern.startswith(".") or pattern.endswith("."):
            raise ValueError(f"shard condition {pattern!r} is not a module path such as 'blocks.<i>'")
        self.pattern = pattern
        parts = (r"\d+" if p == "<i>" else re.escape(p) for p in pattern.split("."))
        self._re = re.compile(r"\.".join(parts) + r"\Z")

    def __call__(self, name: str, module: Any) -> bool:
        return self._re.match(name) is not None

    def __repr__(self) -> str:
        return f"{self.pattern!r}"


def _compile(conditions: ConditionSpec | Iterable[ConditionSpec]) -> tuple[ShardCondition, ...]:
    items = [conditions] if isinstance(conditions, str) or callable(conditions) else list(conditions)
    out: list[ShardCondition] = []
    for c in items:
        if isinstance(c, str):
            out.append(_PathCondition(c))
        elif callable(c):
            out.append(c)
        else:
            raise TypeError(f"a shard condition is a module path such as 'blocks.<i>' or a callable "
                            f"(name, module) -> bool, got {c!r}")
    if not out:
        raise ValueError("register_shard_conditions needs at least one condition")
    return tuple(out)


def register_shard_conditions(cls_or_name: type | str, conditions: ConditionSpec | Iterable[ConditionSpec]) -> None:
    """Make ``load_pipeline`` shard models of class `cls_or_name` (a class, or its name)
    into the units `conditions` select: module paths with ``<i>`` for an index
    (``"blocks.<i>"``) or callables ``(name, module) -> bool``. Replaces an earlier entry."""
    if not isinstance(cls_or_name, (str, type)):
        raise TypeError(f"register_shard_conditions takes a class or a class name, got {cls_or_name!r}")
    _REGISTRY[cls_or_name] = _compile(conditions)


def shard_conditions_for(cls: type) -> tuple[ShardCondition, ...] | None:
    """The conditions for model class `cls`: its own ``_hsdp_shard_conditions``, else the
    registry's entry for it or its nearest base class; None when there is none."""
    own = getattr(cls, "_hsdp_shard_conditions", None)
    if own:
        return _compile(own)
    for k in cls.__mro__:
        for key in (k, k.__name__):
            if key in _REGISTRY:
                return _REGISTRY[key]
    return None


def describe(conditions: Iterable[ShardCondition]) -> str:
    return ", ".join(repr(c) if isinstance(c, _PathCondition) else getattr(c, "__name__", repr(c)) for c in conditions)


register_shard_conditions("WanTransformer3DModel", "blocks.<i>")
register_shard_conditions("FluxTransformer2DModel", ["transformer_blocks.<i>", "single_transformer_blocks.<i>"])
register_shard_conditions("LTXVideoTransformer3DModel", "transformer_blocks.<i>")
register_shard_conditions("QwenImageTransformer2DModel", "transformer_blocks.<i>")
register_shard_conditions("T5EncoderModel", "encoder.block.<i>")
register_shard_conditions("UMT5EncoderModel", "encoder.block.<i>")
# transformers 5 builds CLIPTextModel without the text_model level that 4.x (and checkpoints) have
register_shard_conditions("CLIPTextModel", ["text_model.encoder.layers.<i>", "encoder.layers.<i>"])
register_shard_conditions("CLIPTextModelWithProjection", ["text_model.encoder.layers.<i>", "encoder.layers.<i>"])
