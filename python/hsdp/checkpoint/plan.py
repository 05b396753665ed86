"""Matching a model's parameters to a checkpoint's tensors, and every check that can be made
before a byte is read: missing and unexpected names (one error listing them all), then
shapes and dtypes (one error naming each mismatched tensor)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..adapters import adapter_for
from .errors import CheckpointError, CheckpointKeyError, describe_file, shown, shown_value
from .format import EntryTable, TensorEntry
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


# Missing or unexpected names listed in an error, at most (the rest are counted).
MAX_LISTED = 20


def _mapped(ckpt: Checkpoint, fn: Callable[[str], str | None]) -> Iterator[tuple[str, str, EntryTable, int]]:
    """(checkpoint name, model name, table, position) of every tensor the key_map keeps."""
    for f in ckpt.files:
        t = f.entries
        if t is None:
            continue
        for i, name in enumerate(t):
            target = fn(name)
            if target is None:
                continue
            if not isinstance(target, str):
                raise TypeError(f"key_map returned {shown_value(target)} for {describe_file(f.path)}, tensor "
                                f"'{shown(name)}'; it must return a str or None")
            yield name, target, t, i


def _both(ckpt: Checkpoint, first: str, second: str, target: str) -> CheckpointError:
    return CheckpointError(f"checkpoint '{shown(ckpt.path)}': tensors '{shown(first)}' and '{shown(second)}' "
                           f"both map to '{shown(target)}'")


def map_names(ckpt: Checkpoint, key_map: KeyMap | None) -> dict[str, TensorEntry]:
    """Model name -> entry for every tensor; a key_map returning None drops that tensor."""
    out: dict[str, TensorEntry] = {}
    for name, target, t, i in _mapped(ckpt, _mapper(key_map)):
        if target in out:
            raise _both(ckpt, out[target].name, name, target)
        out[target] = t.entry_at(i)
    return out


def _shown(name: str, stored: str, file: str, ckpt: Checkpoint) -> str:
    note = "" if name == stored else f"stored as '{shown(stored)}'"
    if len(ckpt.files) > 1:  # say which file, so the stray tensor can be found
        note += (", " if note else "") + f"in {shown(os.path.basename(file))}"
    return f"{shown(name)!r} ({note})" if note else repr(shown(name))


def _match(ckpt: Checkpoint, key_map: KeyMap | None, known: set[str]) -> tuple[dict[str, TensorEntry], int, list[str]]:
    """The entries of the model's names (``known``), and how many other tensors the checkpoint
    holds with the first MAX_LISTED of them shown. Only the model's entries become objects:
    a checkpoint of a million tensors costs its compact tables, not a million entries."""
    found: dict[str, TensorEntry] = {}
    others: list[str] = []
    if key_map is None:  # names as they are: look the model's up, count the rest
        for n in known:
            for f in ckpt.files:
                i = f.entries.index(n) if f.entries is not None else -1
                if i >= 0:
                    found[n] = f.entries.entry_at(i)  # type: ignore[union-attr]
                    break
        count = len(ckpt) - len(found)
        if count:
            for f in ckpt.files:
                for n in f.entries or ():
                    if n not in known and len(others) < MAX_LISTED:
                        others.append(_shown(n, n, f.path, ckpt))
        return found, count, others
    count = 0
    for name, target, t, i in _mapped(ckpt, _mapper(key_map)):
        if target in known:
            if target in found:
                raise _both(ckpt, found[target].name, name, target)
            found[target] = t.entry_at(i)
        else:
            count += 1
            if len(others) < MAX_LISTED:
                others.append(_shown(target, name, t.entry_at(i).file.path, ckpt))
    return found, count, others


def _listed(names: list[str], count: int, budget: int = 700) -> str:
    """Names joined, as many as fit in ``budget`` characters (so that a message listing both
    missing and unexpected names stays under the cap), and how many more there are."""
    kept: list[str] = []
    used = 0
    for n in names:
        if kept and used + len(n) + 2 > budget:
            break
        kept.append(n)
        used += len(n) + 2
    more = f" and {count - len(kept)} more" if count > len(kept) else ""
    return ", ".join(kept) + more


def _check_keys(
    model: Any, ckpt: Checkpoint, found: dict[str, TensorEntry], aliases: dict[int, list[str]],
    unexpected: tuple[int, list[str]], mapped: bool,
) -> None:
    missing = [names[0] for names in aliases.values() if not any(n in found for n in names)]
    count, others = unexpected
    if not (missing or count):
        return
    after = " (names after key_map)" if mapped else ""
    lines = [f"checkpoint '{shown(ckpt.path)}' does not match {type(model).__name__}{after}:"]
    if missing:
        lines.append(f"  {len(missing)} missing: " + _listed([repr(shown(n)) for n in missing[:MAX_LISTED]],
                                                             len(missing)))
    if count:
        lines.append(f"  {count} unexpected: " + _listed(others, count))
    raise CheckpointKeyError("\n".join(lines))


def _mismatch(ad: Any, name: str, p: Any, e: TensorEntry) -> str | None:
    if ad.shape(p) != e.shape:
        return f"{e.where}: shape {shown_value(e.shape)} does not match parameter '{shown(name)}' of shape {ad.shape(p)}"
    pd = ad.dtype(p)
    # Floats convert (rounding to the storage dtype); integers and bools must match exactly,
    # as the C data path requires: a silent int cast would change packed weights.
    if e.dtype != pd and not (e.dtype.is_floating_point and pd.is_floating_point):
        return f"{e.where}: dtype {e.dtype.name} cannot be loaded into parameter '{shown(name)}' of dtype {pd.name}"
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
    known = {n for names in aliases.values() for n in names}
    found, count, others = _match(ckpt, key_map, known)
    _check_keys(model, ckpt, found, aliases, (count, others), key_map is not None)
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
        listed = "\n  ".join(errors[:MAX_LISTED]) + (f"\n  and {len(errors) - MAX_LISTED} more" if len(errors) > MAX_LISTED else "")
        raise CheckpointError(f"checkpoint '{shown(ckpt.path)}' does not fit {type(model).__name__}:\n  {listed}")
    return LoadPlan(ckpt, items)
