"""Every ``torch.load`` of the package and its recipes reads tensors only (``weights_only=True``):
the package allows torch 2.4-2.5, where a plain ``torch.load`` runs whatever code the pickle holds
(issue 32, item 7)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch

from hf_constrained.clip.heads import HEADS_CONFIG, HEADS_FILE, CLIPWithClassTextHeads

ROOT = Path(__file__).resolve().parents[2]
RAN: list[str] = []


class _RunsCode:
    def __reduce__(self):  # unpickling calls RAN.append("code")
        return (RAN.append, ("code",))


def _torch_load_calls(path: Path) -> list[tuple[int, bool]]:
    """(line, whether weights_only=True is passed) for each ``torch.load(...)`` call in ``path``."""
    calls = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
            safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                       for k in node.keywords)
            calls.append((node.lineno, safe))
    return calls


def test_every_torch_load_in_the_package_and_recipes_passes_weights_only_true():
    files = sorted((ROOT / "hf_constrained").rglob("*.py")) + sorted((ROOT / "recipes").rglob("*.py"))
    found = {str(p.relative_to(ROOT)): _torch_load_calls(p) for p in files}
    unsafe = [f"{f}:{line}" for f, calls in found.items() for line, safe in calls if not safe]
    assert unsafe == []
    assert sum(len(c) for c in found.values()) >= 2  # the scan sees the calls (heads, constraint state)


def test_class_text_heads_refuse_a_pickle_that_runs_code(tmp_path, monkeypatch):
    """A heads file that would run code is refused with an error naming it, and the code never runs,
    also where torch's own default would load it (torch < 2.6: emulated by defaulting weights_only to False)."""
    real_load = torch.load

    def old_default(*args, **kwargs):
        kwargs.setdefault("weights_only", False)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", old_default)
    from transformers import CLIPModel

    monkeypatch.setattr(CLIPModel, "from_pretrained", classmethod(lambda cls, path, **kw: _tiny_clip()))
    (tmp_path / HEADS_CONFIG).write_text('{"num_classes": 2, "rank": 1}')
    torch.save({"head_a": torch.zeros(2, 32, 1), "head_b": torch.zeros(2, 1, 16), "x": _RunsCode()},
               tmp_path / HEADS_FILE)
    RAN.clear()
    with pytest.raises(ValueError, match=HEADS_FILE):
        CLIPWithClassTextHeads.from_pretrained(str(tmp_path))
    assert RAN == []


def _tiny_clip():
    from hf_constrained.clip.tiny import tiny_clip

    return tiny_clip(20, image_size=8, patch_size=4, hidden_size=32, layers=1, heads=2, projection_dim=16)


def test_class_text_heads_still_round_trip(tmp_path):
    heads = CLIPWithClassTextHeads(_tiny_clip(), num_classes=2, rank=1)
    with torch.no_grad():
        heads.head_b.normal_()
    heads.save_pretrained(str(tmp_path))
    again = CLIPWithClassTextHeads.from_pretrained(str(tmp_path))
    torch.testing.assert_close(again.head_b, heads.head_b)
    assert os.path.isfile(tmp_path / HEADS_FILE)
