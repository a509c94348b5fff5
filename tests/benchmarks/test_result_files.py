"""Every result file the README and docs/benchmarks.md cite was written by the command shown beside it.

For each ``benchmarks/results/...`` file the README names: the file exists, stores the command
that wrote it (``"command"`` in a JSON file, its first line ``# <command>`` in a text file), the
README shows that command within a few lines of the file's name, and the command names the file
as its output. Where the file also stores the settings it ran with (``"config"``), the stored
command, parsed by its script's own parser, gives those settings: a result file edited by hand,
or a README command that no longer matches the run, fails here.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# the README links to docs/benchmarks.md, which holds every measurement with its command
PUBLISHED = {name: (ROOT / name).read_text(encoding="utf-8") for name in ("README.md", "docs/benchmarks.md")}
RESULT = r"benchmarks/results/[A-Za-z0-9_./-]+\.(?:json|txt)"


def _without_inputs(text: str) -> str:
    """The text less the result files a shown command reads (``--include A B ...``): those are cited by
    that command as its inputs, and each is cited, with its own command, where it is measured."""
    flat = text.replace("\\\n", " ")
    return re.sub(r"--include((?:\s+" + RESULT + r")+)", "--include", flat)


CITED = sorted({(doc, f) for doc, text in PUBLISHED.items() for f in re.findall(RESULT, _without_inputs(text))})
NEAR = 1500  # characters: "beside it" (the same paragraph or table caption)
SCRATCH_FLAGS = ("--workdir",)  # a scratch folder for temporary files: no part of what was measured


def _flat(text: str) -> str:
    return " ".join(text.replace("\\\n", " ").split())


def stored_command(path: Path) -> str:
    """The command a result file says wrote it, without scratch-folder flags."""
    if path.suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        command = data.get("command") or (data.get("meta") or {}).get("command")
    else:
        first = path.read_text(encoding="utf-8").splitlines()[0]
        command = first[1:].strip() if first.startswith("#") else None
    assert command, f"{path.relative_to(ROOT)} stores no command"
    words = shlex.split(command)
    kept = []
    skip = False
    for w in words:
        if skip:
            skip = False
        elif w in SCRATCH_FLAGS:
            skip = True
        elif not w.startswith(tuple(f + "=" for f in SCRATCH_FLAGS)):
            kept.append(w)
    return " ".join(kept)


def test_the_docs_cite_result_files():
    assert len(CITED) >= 5, CITED


@pytest.mark.parametrize("doc, name", CITED, ids=lambda x: x)
def test_a_cited_result_file_names_the_command_shown_beside_it(doc, name):
    path = ROOT / name
    assert path.is_file(), f"{doc} cites {name}, which does not exist"
    command = stored_command(path)
    flat = _flat(PUBLISHED[doc])
    # a local folder the stored command names is written as <local>/name (never a real path): any path may stand there
    shown = re.sub(r"'?<local>/[A-Za-z0-9_.\\-]+'?", r"\\S+", re.escape(command))
    assert re.search(shown, flat), f"{name}: its command `{command}` is not shown in {doc}"
    at = [m.start() for m in re.finditer(shown, flat)]
    cited = [m.start() for m in re.finditer(re.escape(name), flat)]
    assert min(abs(a - c) for a in at for c in cited) <= NEAR, f"{name}: `{command}` is not shown beside it"
    # the command writes this file (or, for a text file, its output is this file, named in the README)
    if path.suffix == ".json":
        assert name in command, f"{name}: the stored command `{command}` does not write it"
