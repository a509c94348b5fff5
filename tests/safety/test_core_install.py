"""Core versus extras: with every optional package hidden (as after a plain ``pip install
hf_constrained``), a constrained run trains, is certified, writes its report and card, and the
gate refuses an uncertified push; a call that needs an extra says which one to install."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hf_constrained.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[2]

# the import names of every optional distribution (and what they would pull in)
HIDDEN = ("matplotlib", "sklearn", "PIL", "peft", "tensorboard", "tensorboardX", "trl", "mapie")

# a process that cannot find the packages named in HIDDEN (set before this preamble runs)
HIDE_PREAMBLE = textwrap.dedent('''
    import importlib.machinery, json, os, sys

    class Hide:
        """Answers 'not installed' for the hidden packages, to import and to find_spec alike."""
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in HIDDEN:
                return None
            return importlib.machinery.PathFinder.find_spec(name, path, target)
        def find_distributions(self, *args, **kwargs):
            return importlib.machinery.PathFinder.find_distributions(*args, **kwargs)
        def invalidate_caches(self):
            importlib.machinery.PathFinder.invalidate_caches()

    # replace the path finder, so nothing finds the hidden packages
    sys.meta_path[:] = [Hide() if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
''')

SCRIPT = "import sys\nHIDDEN = set(sys.argv[2].split(','))\n" + HIDE_PREAMBLE + textwrap.dedent('''
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import PretrainedConfig, PreTrainedModel

    from hf_constrained import (Certification, ConstrainedTrainer, ConstrainedTrainingArguments, Constraint,
                                UnsafeModelError, finish_run)
    from hf_constrained.extras import MissingExtraError

    class Config(PretrainedConfig):
        model_type = "core_install_theta"

    class Theta(PreTrainedModel):
        config_class = Config
        def __init__(self, config):
            super().__init__(config)
            self.theta = torch.nn.Parameter(torch.zeros(()))
            self.post_init()
        def _init_weights(self, module):
            pass
        def forward(self, x=None, labels=None, **_):
            return {"loss": (self.theta - 5.0) ** 2}

    def rate(model, batch):  # one value per row, in [0, 1]
        return batch["x"].float() * model.theta / 5.0

    def rows(seed, n):
        return Dataset.from_dict({"x": np.random.default_rng(seed).uniform(0.0, 0.4, n).tolist()})

    def run(name, tolerance):
        args = ConstrainedTrainingArguments(
            output_dir=os.path.join(sys.argv[1], name), per_device_train_batch_size=4, learning_rate=0.1,
            optim="sgd", max_steps=2, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
            constraint_batch_size=4)
        torch.manual_seed(0)
        trainer = ConstrainedTrainer(
            model=Theta(Config()), args=args, train_dataset=Dataset.from_dict({"x": [1.0] * 16}),
            constraints=[Constraint("rate", row_fn=rate, dataset=rows(1, 40), eval_dataset=rows(2, 40),
                                    tolerance=tolerance,
                                    certify=Certification(dataset=rows(3, 300), value_range=(0.0, 1.0)))])
        trainer.train()
        return trainer, finish_run(trainer, eval_dataset="synthetic")

    out = {}
    trainer, report = run("certified", 0.2)
    out["certified"] = report.certified
    out["files"] = sorted(os.listdir(trainer.args.output_dir))
    trainer, report = run("uncertified", 0.01)
    out["uncertified"] = report.certified
    try:
        trainer.push_to_hub()
        out["push"] = "uploaded"
    except UnsafeModelError as err:
        out["push"] = "refused: " + str(err).splitlines()[0]

    def error(call):
        try:
            call()
        except MissingExtraError as err:
            return str(err)
        return None

    out["plots"] = error(lambda: finish_run(trainer, plots=True))
    out["fairness"] = error(lambda: __import__("hf_constrained.fairness.data"))
    from hf_constrained.clip.data import _load_image
    open(os.path.join(sys.argv[1], "x.png"), "wb").close()
    out["clip"] = error(lambda: _load_image(os.path.join(sys.argv[1], "x.png")))
    from hf_constrained.fairness.model import MLPForScoring  # what a ROC model's card imports: core only
    out["hidden_loaded"] = sorted(m for m in sys.modules if m.split(".")[0] in HIDDEN)
    print("RESULT " + json.dumps(out))
''')


@pytest.mark.slow
def test_core_install_trains_certifies_and_gates_without_any_extra(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), ",".join(HIDDEN)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["certified"] is True and out["uncertified"] is False
    # report, card and trainer state, without figures (and a log line naming the extra)
    assert {"safety_report.json", "README.md", "trainer_state.json"} <= set(out["files"])
    assert "figures" not in out["files"] and "pip install 'hf_constrained[figures]'" in proc.stderr
    assert out["push"].startswith("refused: ")
    assert "pip install 'hf_constrained[figures]'" in out["plots"]
    assert "pip install 'hf_constrained[fairness]'" in out["fairness"]
    assert "pip install 'hf_constrained[clip]'" in out["clip"]
    assert out["hidden_loaded"] == []


def test_extras_in_pyproject_match_the_library():
    """Each extra the library names exists in pyproject.toml with its distributions; ``all`` and
    ``dev`` hold every one; none of them is a core dependency."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def names(specs):
        return {s.split(">")[0].split("=")[0].split("<")[0].strip().lower() for s in specs}

    core = names(project["dependencies"])
    for extra, dists in EXTRAS.items():
        assert names(extras[extra]) == set(dists), extra
        assert not set(dists) & (core - {"pandas"}), extra
    every = set().union(*EXTRAS.values())
    assert every <= names(extras["all"]) and every <= names(extras["dev"])
    assert every - {"trl"} <= names(extras["recipes"])
    assert {"matplotlib", "scikit-learn", "pillow", "peft"}.isdisjoint(core)


RECIPE_SCRIPT = "HIDDEN = {'sklearn'}\n" + HIDE_PREAMBLE + textwrap.dedent('''
    from hf_constrained.cli import main
    sys.exit(main(sys.argv[1:]))
''')


@pytest.mark.parametrize("argv", [["quickstart", "--compare", "false"], ["demo", "--seeds", "0"]])
def test_a_recipe_without_its_extra_is_a_one_line_error_naming_it(argv, tmp_path):
    """The digits examples need scikit-learn (an extra): without it the command says which extra to
    install, with no traceback, whether the recipe imports it at once (quickstart) or late (demo)."""
    command = argv[0]
    # (a recipe's --help is printed without importing it, so it needs no extra: a run does)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), HF_CONSTRAINED_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", RECIPE_SCRIPT, *argv], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert f"hf-constrained {command}: error:" in proc.stderr and "'sklearn'" in proc.stderr
    assert proc.stderr.count(f"hf-constrained {command}") == 1, proc.stderr  # the command named once
    assert "pip install 'hf_constrained[recipes]'" in proc.stderr
