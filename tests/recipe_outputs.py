"""Checks every recipe's own output folder must pass: ``hf-constrained report --check`` vouches
for it (the report is intact and names the weight files there), and the card's usage snippet
runs as written once the Hub id is replaced by the folder (the Hub's downloads served from it)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Optional
from unittest import mock

from hf_constrained.publishing.report import SafetyReport
from hf_constrained.publishing.verify import EXIT_CERTIFIED, EXIT_NOT_CERTIFIED, check_run_dir


def assert_report_checks(folder: os.PathLike, certified: Optional[bool] = None) -> SafetyReport:
    """``report --check`` gives 0 (certified) or 1 (not certified), never 2 (stale, unreadable, or
    describing other files), and its verdict is the report's own."""
    check = check_run_dir(str(folder))
    assert check.exit_code in (EXIT_CERTIFIED, EXIT_NOT_CERTIFIED), check.message
    assert check.report is not None and check.message.startswith(check.report.summary())
    assert (check.exit_code == EXIT_CERTIFIED) == check.report.all_satisfied
    if certified is not None:
        assert check.report.certified is certified, check.message
    assert check.report.weights_files_fingerprint is not None  # it names the weight files next to it
    return check.report


def card_snippet(card: str) -> str:
    """The Python block of the card's "How to use" section."""
    section = card.split("## How to use", 1)[1]
    return section.split("```python\n", 1)[1].split("\n```", 1)[0]


def run_card_snippet(folder: os.PathLike) -> dict[str, Any]:
    """Execute the card's snippet with its Hub id replaced by ``folder``; returns its namespace."""
    folder = Path(folder)
    snippet = card_snippet((folder / "README.md").read_text())
    match = re.search(r'^repo_id = "([^"]+)"', snippet, re.M)
    assert match, snippet
    repo_id = match.group(1)
    assert re.fullmatch(r"[\w.-]+/[\w.-]+", repo_id), f"the repo id {repo_id!r} needs an owner"
    assert str(folder) not in snippet  # no local path in a published card

    def hf_hub_download(repo: str, filename: str, **_: Any) -> str:  # the Hub, served from the folder
        assert repo == str(folder)
        return str(folder / filename)

    namespace: dict[str, Any] = {}
    with mock.patch("huggingface_hub.hf_hub_download", hf_hub_download):
        exec(snippet.replace(f'"{repo_id}"', repr(str(folder))), namespace)  # noqa: S102 (the card's own code)
    return namespace
