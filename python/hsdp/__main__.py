"""``python -m hsdp COMMAND ...`` (also installed as ``hsdp``).

Commands:

- ``generate``: prompt to video (or image) from a diffusers pipeline folder, its weights
  sharded across ranks (:mod:`hsdp.cli.generate`).

Each command lives in its own module under :mod:`hsdp.cli`, imported only when it runs.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# name -> (module with main(argv) -> int, one line of help).
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("hsdp.cli.generate", "prompt to video (or image) from a diffusers pipeline folder, sharded"),
    "serve": ("hsdp.serve.cli", "serve a pipeline folder, sharded, over vllm-omni's video / OpenAI's image HTTP API"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    return ("usage: python -m hsdp COMMAND [ARGS...]   (or: hsdp COMMAND ...)\n\ncommands:\n"
            + "\n".join(lines) + "\n\n`python -m hsdp COMMAND --help` describes a command's flags.\n")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        (sys.stdout if argv else sys.stderr).write(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        sys.stderr.write(f"hsdp: error: unknown command {name!r}; commands: {', '.join(COMMANDS)}\n\n" + _usage())
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest))


if __name__ == "__main__":
    sys.exit(main())
