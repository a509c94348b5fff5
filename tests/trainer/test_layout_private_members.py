"""Every use of a private ``transformers.Trainer`` member is in ``hf_constrained/trainer_internals.py``.

A private member is a name with one leading underscore that the ``Trainer`` class has
(``dir(Trainer)``) or that ``Trainer`` assigns as ``self._name``. A use is an attribute
access (``self._x``, ``super()._x``, ``trainer._x``), a method definition ``def _x``, or a
``getattr``/``setattr``/``hasattr``/``delattr`` with the name as a string. The package's own
private helpers (``self._outer``) are no ``Trainer`` member and are not counted.
"""

from __future__ import annotations

import ast
import inspect
import os
import re

import pytest
import transformers
import transformers.trainer
from packaging.requirements import Requirement
from packaging.version import Version

from hf_constrained import trainer_internals
from hf_constrained.trainer_internals import PRIVATE_MEMBERS, TrainerInternals

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE_DIR = os.path.join(REPO, "hf_constrained")
INTERNALS = os.path.join(PACKAGE_DIR, "trainer_internals.py")

# (private member, public hook, arguments of a call, whether it returns a value) for every
# private member TrainerInternals overrides
OVERRIDES = [
    ("_save_checkpoint", "save_checkpoint", ("model", "trial"), False),
    ("_push_from_checkpoint", "push_checkpoint", ("folder",), False),
    ("_determine_best_metric", "is_new_best", ({"eval_loss": 1.0}, "trial"), True),
    ("_get_train_sampler", "train_sampler", ("dataset",), True),
    ("_remove_unused_columns", "drop_unused_columns", ("dataset", "train"), True),
    ("_get_collator_with_removed_columns", "collator_without_unused_columns", ("collator", "train"), True),
]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_trainer_members() -> set[str]:
    """Single-underscore names of ``transformers.Trainer``: its attributes and methods, and the
    instance attributes its methods assign (``self._x = ...``)."""
    names = {n for n in dir(transformers.Trainer) if _is_private(n)}
    tree = ast.parse(inspect.getsource(transformers.trainer))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer"]
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for t in targets:
            if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                    and _is_private(t.attr)):
                names.add(t.attr)
    return names


def private_uses(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, member) for every use of a name of ``names`` in ``source`` (see the module docstring)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in names:
            found.append((node.lineno, node.attr))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names:
            found.append((node.lineno, node.name))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in names):
            found.append((node.lineno, node.args[1].value))
    return sorted(found)


def package_files() -> list[str]:
    out = []
    for directory, _, files in os.walk(PACKAGE_DIR):
        out.extend(os.path.join(directory, f) for f in files if f.endswith(".py"))
    return sorted(out)


def test_scanner_finds_every_kind_of_use():
    """The checker itself: overrides, super() and other calls, getattr strings are found; the
    package's own private names and public Trainer names are not."""
    names = private_trainer_members()
    assert {"_save_checkpoint", "_prepare_input", "_globalstep_last_logged"} <= names  # method, instance attribute
    assert "_outer" not in names and "train" not in names
    src = (
        "class T(Trainer):\n"
        "    def _save_checkpoint(self, model, trial):\n"          # 2: override
        "        super()._save_checkpoint(model, trial)\n"         # 3: super call
        "        self._outer(1)\n"                                  # ours: not counted
        "        self.train()\n"                                    # public: not counted
        "def f(trainer):\n"
        "    x = trainer._prepare_input(1)\n"                      # 7: call on another object
        "    return getattr(trainer, '_get_output_dir')(None)\n"   # 8: getattr string
    )
    assert private_uses(src, names) == [(2, "_save_checkpoint"), (3, "_save_checkpoint"),
                                        (7, "_prepare_input"), (8, "_get_output_dir")]


def test_private_trainer_members_are_used_only_in_trainer_internals():
    names = private_trainer_members()
    outside = []
    for path in package_files():
        if path == INTERNALS:
            continue
        with open(path, encoding="utf-8") as f:
            for line, name in private_uses(f.read(), names):
                outside.append(f"{os.path.relpath(path, REPO)}:{line}: {name}")
    assert not outside, ("private transformers.Trainer members used outside hf_constrained/trainer_internals.py "
                         "(add a public hook there):\n" + "\n".join(outside))


def test_trainer_internals_declares_and_explains_every_member_it_uses():
    """``PRIVATE_MEMBERS`` is exactly what the module uses (its import check covers them all),
    the module docstring says for each why no public hook serves, and each exists in the
    installed Trainer."""
    with open(INTERNALS, encoding="utf-8") as f:
        used = {name for _, name in private_uses(f.read(), private_trainer_members())}
    assert used == set(PRIVATE_MEMBERS)
    doc = trainer_internals.__doc__
    why = doc[doc.index("Why no public hook serves"):]
    for name in PRIVATE_MEMBERS:
        assert f"``{name}``" in why, f"{name} is not explained in the trainer_internals docstring"
        assert callable(getattr(transformers.Trainer, name, None)), name


@pytest.mark.parametrize("private, hook, args, returns", OVERRIDES, ids=[o[0] for o in OVERRIDES])
def test_private_member_forwards_to_its_hook_whose_default_is_the_trainers(private, hook, args, returns,
                                                                          monkeypatch):
    """The Trainer's call of the private member reaches the public hook with the same
    arguments, and the hook's default is the Trainer's own member (no model needed: the
    calls are routed on a bare instance)."""
    trainer = TrainerInternals.__new__(TrainerInternals)
    calls = []
    monkeypatch.setattr(trainer, hook, lambda *a: calls.append(("hook", a)) or "from hook", raising=False)
    assert getattr(trainer, private)(*args) == ("from hook" if returns else None)
    assert calls == [("hook", args)]

    trainer = TrainerInternals.__new__(TrainerInternals)

    def trainers_member(self, *a, **kw):
        calls.append(("trainer", a + tuple(kw.values())))
        return "from trainer"

    monkeypatch.setattr(transformers.Trainer, private, trainers_member)
    assert getattr(trainer, hook)(*args) == ("from trainer" if returns else None)
    assert calls[-1] == ("trainer", args)


def test_constrained_trainer_routes_through_trainer_internals():
    """ConstrainedTrainer overrides the public hooks of TrainerInternals only (the safety loop is a component the
    trainer holds, not a base class: nothing sits between them)."""
    from hf_constrained import ConstrainedTrainer

    mro = ConstrainedTrainer.__mro__
    assert mro[:3] == (ConstrainedTrainer, TrainerInternals, transformers.Trainer)
    for private, _, _, _ in OVERRIDES:
        assert private not in vars(ConstrainedTrainer)
        assert getattr(ConstrainedTrainer, private) is getattr(TrainerInternals, private)


def test_transformers_range_is_bounded_and_holds_the_installed_version():
    with open(os.path.join(REPO, "pyproject.toml"), encoding="utf-8") as f:
        # the dependency strings of pyproject.toml (a line scan: tomllib needs Python 3.11)
        deps = re.findall(r'^\s*"([^"]+)",', f.read(), flags=re.M)
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == "transformers"]
    assert any(s.operator in ("<", "<=", "~=", "==") for s in req.specifier), f"no upper bound: {req}"
    assert Version(transformers.__version__) in req.specifier


def test_the_trainer_module_stays_small():
    """``hf_constrained/trainer.py`` adapts Algorithm 1 to the Trainer and delegates the rest (the method engine,
    exact evaluation, checkpoint state, the safety loop it holds): at most 400 lines, so that it stays readable."""
    with open(os.path.join(REPO, "hf_constrained", "trainer.py"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) <= 400, f"hf_constrained/trainer.py has {len(lines)} lines: move a concern out"
