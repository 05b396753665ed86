"""Matching a model's parameters to a checkpoint's tensors, and every check that can be made
before a byte is read: missing and unexpected names (one error listing them all), then
shapes and dtypes (one error naming each mismatched tensor)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..adapters import adapter_for
from .errors import CheckpointError, CheckpointKeyError
from .format import TensorEntry
from .index import Checkpoint

KeyMap = Callable[[str], "str | None"] | Mapping[str, str]


@dataclass(frozen=True, eq=False)
class PlannedParam:
    name: str  # the model's name for it
    param: Any
    entry: TensorEntry


class LoadPlan:
    """Each parameter's tensor, by parameter identity (units know parameters, not names)."""

    def __init__(self, checkpoint: Checkpoint, items: list[PlannedParam]) -> None:
        self.checkpoint = checkpoint
        self.items = items
        self._by_id = {id(it.param): it for it in items}

    def entry(self, param: Any) -> TensorEntry:
        return self._by_id[id(param)].entry

    def nbytes(self, params: Any) -> int:
        return sum(self._by_id[id(p)].entry.nbytes for p in params)


def _mapper(key_map: KeyMap | None) -> Callable[[str], str | None]:
    if key_map is None:
        return lambda name: name
    if isinstance(key_map, Mapping):
        table = key_map
        return lambda name: table.get(name, name)
    if not callable(key_map):
        raise TypeError(
            f"key_map must be a callable (checkpoint name -> model name or None) or a mapping, got {key_map!r}"
        )
    return key_map


def map_names(ckpt: Checkpoint, key_map: KeyMap | None) -> dict[str, TensorEntry]:
    """Model name -> entry; a key_map returning None drops that tensor."""
    fn = _mapper(key_map)
    out: dict[str, TensorEntry] = {}
    for name, entry in ckpt.entries.items():
        target = fn(name)
        if target is None:
            continue
        if not isinstance(target, str):
            raise TypeError(f"key_map returned {target!r} for {entry.where}; it must return a str or None")
        if target in out:
            raise CheckpointError(
                f"checkpoint '{ckpt.path}': tensors '{out[target].name}' and '{name}' both map to '{target}'"
            )
        out[target] = entry
    return out


def _shown(name: str, entry: TensorEntry, ckpt: Checkpoint) -> str:
    stored = "" if name == entry.name else f"stored as '{entry.name}'"
    if len(ckpt.files) > 1:  # say which file, so the stray tensor can be found
        stored += (", " if stored else "") + f"in {os.path.basename(entry.file.path)}"
    return f"{name!r} ({stored})" if stored else repr(name)


def _check_keys(
    model: Any, ckpt: Checkpoint, found: dict[str, TensorEntry], aliases: dict[int, list[str]], mapped: bool
) -> None:
    missing = [names[0] for names in aliases.values() if not any(n in found for n in names)]
    known = {n for names in aliases.values() for n in names}
    unexpected = [_shown(n, e, ckpt) for n, e in found.items() if n not in known]
    if not (missing or unexpected):
        return
    after = " (names after key_map)" if mapped else ""
    lines = [f"checkpoint '{ckpt.path}' does not match {type(model).__name__}{after}:"]
    if missing:
        lines.append(f"  {len(missing)} missing: " + ", ".join(repr(n) for n in missing))
    if unexpected:
        lines.append(f"  {len(unexpected)} unexpected: " + ", ".join(unexpected))
    raise CheckpointKeyError("\n".join(lines))


def _mismatch(ad: Any, name: str, p: Any, e: TensorEntry) -> str | None:
    if ad.shape(p) != e.shape:
        return f"{e.where}: shape {e.shape} does not match parameter '{name}' of shape {ad.shape(p)}"
    pd = ad.dtype(p)
    # Floats convert (rounding to the storage dtype); integers and bools must match exactly,
    # as the C data path requires: a silent int cast would change packed weights.
    if e.dtype != pd and not (e.dtype.is_floating_point and pd.is_floating_point):
        return f"{e.where}: dtype {e.dtype.name} cannot be loaded into parameter '{name}' of dtype {pd.name}"
    return None


def plan_load(model: Any, ckpt: Checkpoint, key_map: KeyMap | None = None) -> LoadPlan:
    """Every parameter's entry, or an error; reads no tensor data and changes nothing."""
    ad = adapter_for(model)
    aliases: dict[int, list[str]] = {}
    params: dict[int, Any] = {}
    for name, p in ad.named_parameters(model, remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
        params[id(p)] = p
        if ad.is_sharded(p):
            raise RuntimeError(f"parameter '{name}' is already sharded by hsdp; load into a fresh (meta) model")
    for name, b in ad.named_buffers(model):  # persistent buffers: loaded whole on every rank
        aliases.setdefault(id(b), []).append(name)
        params[id(b)] = b
    found = map_names(ckpt, key_map)
    _check_keys(model, ckpt, found, aliases, key_map is not None)
    items: list[PlannedParam] = []
    errors: list[str] = []
    for pid, names in aliases.items():
        present = [n for n in names if n in found]
        item = PlannedParam(names[0], params[pid], found[present[0]])  # tied weights: the first name present
        for n in present:  # but every tied name the checkpoint holds must fit the parameter
            if (msg := _mismatch(ad, n, item.param, found[n])) is not None:
                errors.append(msg)
        items.append(item)
    if errors:
        listed = "\n  ".join(errors)
        raise CheckpointError(f"checkpoint '{ckpt.path}' does not fit {type(model).__name__}:\n  {listed}")
    return LoadPlan(ckpt, items)
