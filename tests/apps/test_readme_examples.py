"""The README's Python quick start runs as written, with its free names (``model``,
``train_data``, ``constraint_data``, ``held_out``) bound to the quick-start recipe's digits data."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from hf_constrained.recipes.quickstart_digits import DigitClassifier, make_splits

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_quick_start_snippet_runs_as_written(tmp_path, monkeypatch):
    snippet = _python_blocks()[0]
    assert "ConstrainedTrainer(" in snippet and "trainer.train()" in snippet
    monkeypatch.chdir(tmp_path)  # the snippet writes to output_dir="outputs/quickstart"
    train, constraint_data, test = make_splits(0)
    torch.manual_seed(0)
    namespace = {"model": DigitClassifier(), "train_data": train.select(range(160)),
                 "constraint_data": constraint_data, "held_out": test}
    exec(compile(snippet, str(README), "exec"), namespace)  # noqa: S102
    trainer = namespace["trainer"]
    assert trainer.state.global_step > 0
    metrics = trainer.evaluate()
    # the names the snippet's comment promises
    assert {"eval_constraint/digit7", "eval_constraint_max_violation", "eval_constraints_satisfied"} <= set(metrics)
    assert len(trainer.constraints) == 10 and (tmp_path / "outputs" / "quickstart").is_dir()
