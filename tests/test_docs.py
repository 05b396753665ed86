"""Every ```python block in README.md and docs/*.md runs as written.

The convention (the line right before a block's opening fence):

- nothing: the block is a complete program; it runs with this interpreter on 1 rank.
- ``<!-- doctest: ranks=N -->``: it runs under ``python -m hsdp.launch -n N``.
- ``<!-- doctest: fragment -->``: an excerpt that cannot run alone; reported as skipped with
  the reason "fragment", so ``pytest -ra`` lists what is not run.

Any other ``<!-- doctest`` comment (a misspelling, a blank line between it and the fence) is
an error: a marker that silently stops applying would turn a fragment into a failing block,
or a multi-rank block into a 1-rank one.

Each block runs in a fresh temporary working directory, as its own process: blocks in one
file share no state. The docs present every block as a complete script, so none may lean on
names an earlier block defined.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from mpirun import MPI_ENV

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Seconds one block may run, launch included: the blocks use tiny models and take a few
# seconds; a block that takes longer is too slow for the docs, or hangs.
TIMEOUT_S = 120
# A collective that waits this long for its peers ends the job with a message naming it,
# well within TIMEOUT_S, so a hanging multi-rank block fails with a reason.
HSDP_TIMEOUT_S = "60"

_MARKER = re.compile(r"<!--\s*doctest")
_FRAGMENT = "<!-- doctest: fragment -->"
_RANKS = re.compile(r"<!-- doctest: ranks=([1-9][0-9]*) -->")
_FENCE_PY = re.compile(r"^\s*```python\s*$")  # indented too: a block in a list item


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    marker: str  # the line before the fence, stripped
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        if _FENCE_PY.match(lines[i]):
            end = i + 1
            while end < len(lines) and not lines[end].lstrip().startswith("```"):
                end += 1
            if end == len(lines):
                raise AssertionError(f"{path.relative_to(ROOT)}:{i + 1}: ```python block never closed")
            marker = lines[i - 1].strip() if i > 0 else ""
            code = textwrap.dedent("\n".join(lines[i + 1 : end]) + "\n")
            found.append(Block(path, i + 1, marker, code))
            i = end
        i += 1
    return found


BLOCKS = [b for doc in DOCS for b in _blocks(doc)]


def _ranks(block: Block) -> int | None:
    """Ranks to launch with hsdp.launch; 0 for plain python; None for a fragment.

    Fails the test on a malformed marker.
    """
    if block.marker == _FRAGMENT:
        return None
    m = _RANKS.fullmatch(block.marker)
    if m:
        return int(m.group(1))
    if _MARKER.search(block.marker):
        pytest.fail(
            f"{block.name}: unknown doctest marker {block.marker!r}; "
            f"the forms are {_FRAGMENT!r} and '<!-- doctest: ranks=N -->'"
        )
    return 0


def test_markers_are_well_formed() -> None:
    """Every doctest marker has one of the two forms and sits right before a ```python fence."""
    bad = []
    for doc in DOCS:
        lines = doc.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if not _MARKER.search(line):
                continue
            where = f"{doc.relative_to(ROOT)}:{i + 1}"
            text = line.strip()
            if text != _FRAGMENT and not _RANKS.fullmatch(text):
                bad.append(f"{where}: {text!r} is neither {_FRAGMENT!r} nor '<!-- doctest: ranks=N -->'")
            elif i + 1 >= len(lines) or not _FENCE_PY.match(lines[i + 1]):
                bad.append(f"{where}: {text!r} is not on the line right before a ```python fence")
    assert not bad, "malformed doctest markers:\n" + "\n".join(bad)


def test_blocks_found() -> None:
    """The collector sees the docs' blocks (a broken parser would make every case vanish)."""
    assert len(BLOCKS) >= 19, [b.name for b in BLOCKS]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_doc_block_runs(block: Block, tmp_path: Path) -> None:
    ranks = _ranks(block)
    if ranks is None:
        pytest.skip(f"fragment: {block.name}")
    script = tmp_path / "block.py"
    script.write_text(block.code, encoding="utf-8")
    env = {**os.environ, **MPI_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")]))
    env.setdefault("HSDP_TIMEOUT", HSDP_TIMEOUT_S)
    if ranks == 0:
        cmd = [sys.executable, str(script)]
    else:
        cmd = [sys.executable, "-m", "hsdp.launch", "-n", str(ranks), "--", str(script)]
    # A session of its own, so that a timeout ends mpiexec and its ranks too, not only the
    # launcher.
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(
            f"{block.name} ran past {TIMEOUT_S} s ({' '.join(cmd)})\n--- block\n{block.code}"
            f"--- stdout\n{out}\n--- stderr\n{err}"
        )
    if proc.returncode != 0:
        pytest.fail(
            f"{block.name} exited {proc.returncode} on {max(ranks, 1)} rank(s) ({' '.join(cmd)})\n"
            f"--- block\n{block.code}--- stdout\n{out}\n--- stderr\n{err}"
        )
