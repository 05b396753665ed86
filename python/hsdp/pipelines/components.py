"""A pipeline folder's components (``model_index.json``), each with what loading does to it.

- ``transformer``: every diffusers model whose component name starts with ``transformer``
  or whose class name holds ``Transformer``: built empty and streamed sharded.
- ``text_encoder``: every transformers model whose component name starts with
  ``text_encoder``: sharded the same way, or loaded whole with ``shard_text_encoders=False``.
- ``replicated``: everything else (VAE, tokenizers, scheduler, image processors and
  encoders), loaded whole on every rank by diffusers itself.

Reading the folder touches only JSON and safetensors headers, so every bad input (no
``model_index.json``, a missing component folder, a class the libraries do not have, a
model class with no shard conditions) is found before any weight is read.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any, Literal

from .conditions import ShardCondition, shard_conditions_for

Role = Literal["transformer", "text_encoder", "replicated"]

REGISTER_HINT = (
    "register its units first: hsdp.pipelines.register_shard_conditions({cls!r}, ['<module path>.<i>']) "
    "(e.g. 'blocks.<i>' for a transformer's blocks), or set _hsdp_shard_conditions on the class"
)


class PipelineFolderError(ValueError):
    """The folder is not a diffusers pipeline hsdp can load (the message says what and where)."""


@dataclasses.dataclass(frozen=True)
class Component:
    name: str
    library: str
    class_name: str
    cls: type
    role: Role
    folder: Path
    conditions: tuple[ShardCondition, ...] = ()

    @property
    def sharded(self) -> bool:
        return bool(self.conditions)


def read_model_index(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise PipelineFolderError(f"pipeline folder '{path}' does not exist")
    if not path.is_dir():
        raise PipelineFolderError(f"'{path}' is not a folder; load_pipeline takes a diffusers pipeline folder "
                                  "(the one holding model_index.json)")
    index = path / "model_index.json"
    if not index.is_file():
        raise PipelineFolderError(
            f"'{path}' is not a diffusers pipeline folder: it has no model_index.json (a folder written by "
            "DiffusionPipeline.save_pretrained, or a hub snapshot of one; a single model's folder holds only "
            "config.json)"
        )
    try:
        data = json.loads(index.read_text())
    except (OSError, ValueError) as exc:
        raise PipelineFolderError(f"cannot read '{index}': {exc}") from exc
    if not isinstance(data, dict) or "_class_name" not in data:
        raise PipelineFolderError(f"'{index}' names no pipeline class (_class_name)")
    return data


def _import(library: str, class_name: str, where: str) -> type:
    try:
        module = importlib.import_module(library)
    except ImportError as exc:
        raise PipelineFolderError(f"{where}: library {library!r} cannot be imported ({exc})") from exc
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise PipelineFolderError(f"{where}: unknown model class {library}.{class_name} "
                                  f"({library} {getattr(module, '__version__', '')} has no such class)")
    return cls


def pipeline_class(path: Path, index: dict[str, Any]) -> type:
    return _import("diffusers", str(index["_class_name"]), f"'{path / 'model_index.json'}'")


def _role(name: str, library: str, cls: type) -> Role:
    if library == "diffusers" and (name.startswith("transformer") or "Transformer" in cls.__name__):
        from diffusers import ModelMixin

        if issubclass(cls, ModelMixin):
            return "transformer"
    if library == "transformers" and name.startswith("text_encoder"):
        from transformers import PreTrainedModel

        if issubclass(cls, PreTrainedModel):
            return "text_encoder"
    return "replicated"


def read_components(path: Path, shard_text_encoders: bool, use_hsdp: bool) -> list[Component]:
    """Every non-empty component of the pipeline at `path`, checked (see the module docstring)."""
    index = read_model_index(path)
    pipeline_class(path, index)
    out: list[Component] = []
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, (list, tuple)) or len(spec) != 2:
            continue  # config values (boundary_ratio, ...)
        library, class_name = spec
        if library is None or class_name is None:
            continue  # an optional component the pipeline was saved without
        folder = path / name
        where = f"component '{name}' of '{path}'"
        cls = _import(str(library), str(class_name), where)
        if not folder.is_dir():
            raise PipelineFolderError(f"{where} ({library}.{class_name}) has no folder: '{folder}' is missing")
        role = _role(name, str(library), cls)
        conditions: tuple[ShardCondition, ...] = ()
        if use_hsdp and (role == "transformer" or (role == "text_encoder" and shard_text_encoders)):
            found = shard_conditions_for(cls)
            if found is None:
                extra = " (or pass shard_text_encoders=False to load text encoders whole)" \
                    if role == "text_encoder" else ""
                raise PipelineFolderError(
                    f"{where}: hsdp does not know which submodules of {cls.__module__}.{cls.__name__} to shard; "
                    + REGISTER_HINT.format(cls=cls.__name__) + extra
                )
            conditions = found
        out.append(Component(name, str(library), str(class_name), cls, role, folder, conditions))
    for c in out:  # every class checked first: only then the files
        if c.sharded:
            _check_weights(c.folder, f"component '{c.name}' of '{path}'")
    return out


def _check_weights(folder: Path, where: str) -> None:
    """A sharded component streams from safetensors: refuse other formats now, not mid-load."""
    from ..checkpoint import open_checkpoint

    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.safetensors.index.json")):
        present = sorted(p.name for p in folder.iterdir())[:8]
        raise PipelineFolderError(f"{where}: '{folder}' holds no safetensors weights (found {present}); "
                                  "hsdp streams sharded models from safetensors only")
    open_checkpoint(folder).close()  # headers and index: a truncated or inconsistent file fails here
