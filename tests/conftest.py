"""Suite-wide settings and the builders the test folders share.

The tests mirror the package: ``method/`` (Algorithm 1 and its parts, no Trainer needed),
``trainer/`` (the Trainer adapter: steps, resume, checkpoints, processes), ``safety/`` and
``apps/`` (CLIP, fairness, LLM, recipes, command line). Helper modules (``scale_tiny``,
``clip_synthetic``, ``safety_tiny``) live next to this file; tests marked ``slow`` start
processes or train for long (``pytest -m "not slow"`` skips them).
"""

import importlib
import os
import sys
import tempfile
from types import ModuleType, SimpleNamespace

import pytest
import torch
from datasets import Dataset
from torch import nn

from hf_constrained import ConstrainedTrainingArguments

# test helper modules (scale_tiny, clip_synthetic, safety_tiny) import by name
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# recipe help texts rendered by the tests are cached in a folder of this run, not in ~/.cache
os.environ.setdefault("HF_CONSTRAINED_CACHE", tempfile.mkdtemp(prefix="hf_constrained_test_cache_"))
# the user-level ledger of certificate looks, for what runs before a test's own ledger is set (module- and
# session-scoped fixtures, the processes they start): never the user's ~/.cache one
os.environ["HF_CONSTRAINED_LEDGER"] = os.path.join(tempfile.mkdtemp(prefix="hf_constrained_test_ledger_"),
                                                   "certification_ledger.json")


def import_script(folder: str, name: str) -> ModuleType:
    """``<repo>/<folder>/<name>.py`` (a recipe or benchmark script, not part of the package)
    imported by name, as ``python <folder>/<name>.py`` would see its own folder."""
    sys.path.insert(0, os.path.join(REPO_ROOT, folder))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """The tests use tiny models: under ``pytest -n 2`` on 2 cores, several OpenMP threads per
    worker only contend and make them many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def own_certification_ledger(tmp_path_factory, monkeypatch):
    """Each test counts certificate looks in a ledger of its own (never the user's, never another test's):
    the user-level ledger of hf_constrained.certification.ledger is read from $HF_CONSTRAINED_LEDGER."""
    monkeypatch.setenv("HF_CONSTRAINED_LEDGER", str(tmp_path_factory.mktemp("ledger") / "certification_ledger.json"))


# ---------------------------------------------------------------------- a float32 classifier
class TinyNet(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin1 = nn.Linear(3, 8)
        self.drop = nn.Dropout(dropout)
        self.lin2 = nn.Linear(8, 2)

    def forward(self, x, labels=None, **_):
        logits = self.lin2(self.drop(torch.tanh(self.lin1(x))))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


def tiny_rows(n: int = 64, seed: int = 0) -> Dataset:
    """``{"x", "labels"}`` rows for :class:`TinyNet`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    y = (x[:, 0] + 0.3 * torch.randn(n, generator=g) > 0).long()
    return Dataset.from_dict({"x": x.tolist(), "labels": y.tolist()})


def class_loss(model, batch):
    """Mean cross-entropy on the batch (a per-sample mean, so exact evaluation is a weighted mean)."""
    return model(batch["x"], labels=batch["labels"])["loss"]


def tiny_args(tmp_path, **kw) -> ConstrainedTrainingArguments:
    """Plain SGD, constant rate, no clipping: a step is exactly Algorithm 1, line 10."""
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, learning_rate=0.1, optim="sgd",
                weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="constant", report_to=[],
                save_strategy="no", disable_tqdm=True, use_cpu=True, seed=0, logging_steps=2)
    base.update(kw)
    return ConstrainedTrainingArguments(**base)


# ---------------------------------------------------------------------- a float64 classifier, row-wise data
class Net64(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin1 = nn.Linear(3, 8)
        self.lin2 = nn.Linear(8, 2)
        self.double()

    def forward(self, x, labels=None, **_):
        logits = self.lin2(torch.tanh(self.lin1(x.to(self.lin1.weight.dtype))))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


def rows64(n: int, seed: int) -> Dataset:
    """``{"x", "labels", "g" (alternating 0/1), "cls" (0-2)}`` rows for :class:`Net64`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    y = (x[:, 0] + 0.5 * torch.randn(n, generator=g, dtype=torch.float64) > 0).long()
    grp = torch.arange(n) % 2
    cls = torch.randint(0, 3, (n,), generator=g)
    return Dataset.from_dict({"x": x.tolist(), "labels": y.tolist(), "g": grp.tolist(), "cls": cls.tolist()})


def per_row_ce64(model, batch):
    """One output per row: the per-sample cross-entropy (a shared row_fn)."""
    logits = model(batch["x"].double())["logits"]
    return nn.functional.cross_entropy(logits, batch["labels"], reduction="none")


def args64(tmp_path, name: str, **kw) -> ConstrainedTrainingArguments:
    """SGD, no clipping, sampled constraints (|B_c| = 3), gamma' > 0: every part of the step in play."""
    base = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=16, learning_rate=0.2, optim="sgd",
                weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="constant", report_to=[],
                save_strategy="no", disable_tqdm=True, use_cpu=True, seed=0, logging_steps=3, max_steps=8,
                penalty_beta=3.0, msvr_gamma=0.5, msvr_gamma_prime=0.3, constraints_per_step=3,
                constraint_batch_size=8)
    base.update(kw)
    return ConstrainedTrainingArguments(**base)


class UploadRecorder:
    """Stands in for the Hub client the Trainer pushes through (``transformers.trainer.hf_api``):
    answers the gated trainer's access check and records which repositories were created and
    uploaded to, without network."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def whoami(self, token=None):
        return {"name": "user"}

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id))
        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs.get("repo_id")))
        return SimpleNamespace(commit_url="https://example.invalid/commit", oid="0" * 40)

