"""The README's Python quick start runs as written: the whole block, with nothing bound from outside."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.slow
def test_quick_start_snippet_runs_as_written(tmp_path, monkeypatch):
    snippet = _python_blocks()[0]
    assert "ConstrainedTrainer(" in snippet and "trainer.train()" in snippet and "finish_run(" in snippet
    monkeypatch.chdir(tmp_path)  # the snippet writes to output_dir="outputs/quickstart"
    namespace: dict = {}
    exec(compile(snippet, str(README), "exec"), namespace)  # noqa: S102
    trainer, report = namespace["trainer"], namespace["report"]
    assert trainer.state.global_step > 0 and len(trainer.constraints) == 10
    run = tmp_path / "outputs" / "quickstart"
    on_disk = json.loads((run / "safety_report.json").read_text())
    # the verdict the snippet's comment promises: the certificate's, the same in the report file and the card
    assert on_disk["all_satisfied"] is report.certified
    assert report.summary() in (run / "README.md").read_text()
