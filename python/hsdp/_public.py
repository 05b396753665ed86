"""The public module names that outlived the layout by layer (docs/design.md, "File map").

Users import ``hsdp.distributed``, ``hsdp.config``, ``hsdp.nccl`` and run
``python -m hsdp.launch`` / ``python -m hsdp._rank``; the modules live in their layer
(``hsdp.world``, ``hsdp.engine``, ``hsdp.parallel``). This finder makes each public name the
very module object of its home, so ``import hsdp.distributed``, ``from hsdp.config import
...`` and ``python -m hsdp.launch`` reach one module (one ``_world``, one set of
monkeypatchable names), with no copy of it. Code inside hsdp imports the homes.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import CodeType, ModuleType

# public name -> the module's home
PUBLIC_MODULES: dict[str, str] = {
    "hsdp.distributed": "hsdp.world.distributed",
    "hsdp.nccl": "hsdp.world.nccl",
    "hsdp.launch": "hsdp.world.launch",
    "hsdp._rank": "hsdp.world._rank",
    "hsdp.config": "hsdp.engine.config",
    "hsdp.dtypes": "hsdp.engine.dtypes",
    "hsdp.trace": "hsdp.engine.trace",
    "hsdp.ring": "hsdp.parallel.ring",
    "hsdp.parallel_torch": "hsdp.parallel.context",
    "hsdp.ring_torch": "hsdp.parallel.attention",
}


class _PublicNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        home = PUBLIC_MODULES.get(fullname)
        if home is None:
            return None
        real = importlib.util.find_spec(home)
        return importlib.util.spec_from_loader(fullname, self, origin=real.origin if real else None)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(PUBLIC_MODULES[spec.name])  # the home itself, not a copy
        spec.loader_state = module.__spec__  # the import system sets __spec__ to this alias's next
        return module

    def exec_module(self, module: ModuleType) -> None:
        # it ran as its home; it keeps its home's spec (reload, find_spec of the home)
        module.__spec__ = module.__spec__.loader_state

    def get_code(self, fullname: str) -> CodeType | None:
        """For ``python -m hsdp.launch``: runpy runs the home's code as ``__main__``."""
        home = PUBLIC_MODULES[fullname]
        spec = importlib.util.find_spec(home)
        assert spec is not None and isinstance(spec.loader, importlib.abc.InspectLoader), home
        return spec.loader.get_code(home)


def install() -> None:
    if not any(isinstance(f, _PublicNames) for f in sys.meta_path):
        sys.meta_path.append(_PublicNames())
