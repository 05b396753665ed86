"""The package layout by layer: imports run one way (docs/design.md, "File map").

Read from the source (AST), not by importing: every ``import`` and ``from ... import`` in
python/hsdp, at module level or inside a function (a lazy import runs too, later), must
name a module of its own layer or a lower one. Imports under ``if TYPE_CHECKING:`` are left
out: they never run, and annotations may name a protocol from above (the engine annotates
with ``hsdp.adapters.TensorAdapter``, which it reaches only through its registry).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "python" / "hsdp"

# Lowest first. A module may import its own layer and those below, never one above.
LAYERS: list[set[str]] = [
    {"_C", "_public"},  # the C core; the table of public module names
    {"world"},  # the process group, the mesh, NCCL, the launcher
    {"engine"},  # sharding, hooks, schedule, policy, dtypes, trace, the parallel config
    {"adapters", "nn"},  # the frameworks: the adapters, hsdp's own NumPy runtime
    {"models", "checkpoint", "parallel"},  # reference models, checkpoints, sequence/CFG parallel
    {"pipelines", "testing", "hub", "omni", "hsdp"},  # pipelines; hub ids; hsdp.Omni; the facade
    {"cli", "serve", "__main__"},  # the commands
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _module(path: Path) -> str:
    parts = ["hsdp", *path.relative_to(PKG).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _area(module: str) -> str:
    """The layer entry a module belongs to: its first name under hsdp ('hsdp': the facade)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "hsdp"


def _type_only(tree: ast.AST) -> set[int]:
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ids.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return ids


def imports(path: Path, me: str | None = None) -> list[tuple[int, str]]:
    """(line, module) of every hsdp module the file imports at run time; ``me``: the file's
    module name (default: from its place under python/hsdp)."""
    me = me or _module(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    skip = _type_only(tree)
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "hsdp"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "hsdp":
                continue
            if mod == "hsdp":  # `from hsdp import x` / `from .. import x`: each x is what is imported
                out += [(node.lineno, f"hsdp.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, mod))
    return out


def _sources() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def test_every_area_has_a_layer():
    areas = {_area(_module(p)) for p in _sources()}
    assert areas - set(RANK) == set(), f"add these to LAYERS: {sorted(areas - set(RANK))}"


def test_imports_run_one_way():
    upward = []
    for path in _sources():
        me = _module(path)
        for line, target in imports(path):
            if RANK[_area(target)] > RANK[_area(me)]:
                upward.append(f"{path.relative_to(PKG.parent)}:{line}: {me} imports {target}")
    assert upward == [], "imports that run up a layer:\n" + "\n".join(upward)


def test_the_checker_sees_an_upward_import(tmp_path):
    """The rule can fail: a world module importing the engine and a command, lazily, is caught."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from ..engine import api\n    from hsdp import pipelines\n")
    found = [t for _, t in imports(probe, "hsdp.world.probe")]
    assert found == ["hsdp.engine", "hsdp.pipelines"]
    assert all(RANK[_area(t)] > RANK["world"] for t in found)


def test_public_names_are_their_homes_and_import_without_torch():
    """`import hsdp` and the public module names work without torch, and each public name is
    its home's very module object (one module state, one place to patch)."""
    code = (
        "import sys, importlib, hsdp\n"
        "from hsdp._public import PUBLIC_MODULES\n"
        "for public, home in PUBLIC_MODULES.items():\n"
        "    if 'torch' in public or public.endswith('_torch'):\n"
        "        continue  # the torch-only ones (hsdp.parallel_torch, hsdp.ring_torch) import torch\n"
        "    a, b = importlib.import_module(public), importlib.import_module(home)\n"
        "    assert a is b and b.__spec__.name == home, (public, home)\n"
        "from hsdp.distributed import init_process_group\n"
        "assert hsdp.distributed.init_process_group is init_process_group\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
