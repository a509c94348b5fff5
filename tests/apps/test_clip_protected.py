"""hf_constrained.clip.protected: the protected classes' values on held-out rows (the demo's h_test), and the
forgetting violation its checkpoint selection reads."""

import pytest
import torch

from hf_constrained.clip.protected import held_out_values
from hf_constrained.non_forgetting import ReferenceLossDataset
from hf_constrained.safety.in_memory_selection import forgetting_violation
from hf_constrained.statistics import constraint_statistic


class Scale(torch.nn.Module):
    def __init__(self, w: float) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(w))


def row_loss(model, batch):
    return torch.as_tensor(batch["x"]).float() * model.w


def test_held_out_values_are_the_exact_mean_change_and_its_clt_bound():
    rows = [{"x": float(i)} for i in range(6)]
    pools = {"a": ReferenceLossDataset(rows, torch.ones(6)), "b": ReferenceLossDataset(rows, torch.zeros(6))}
    values, bounds = held_out_values(Scale(0.5), pools, row_loss, None, torch.relu)
    change = torch.relu(torch.arange(6.0) * 0.5 - 1.0)  # per row: the loss now minus the old model's, then [.]_+
    assert values["non_forgetting/a"] == pytest.approx(float(change.mean()))
    assert bounds["non_forgetting/a"] == pytest.approx(constraint_statistic(change.double().numpy()).upper_bound)
    plain, _ = held_out_values(Scale(0.5), pools, row_loss, None, name="{task}")
    assert plain == {"a": pytest.approx(float((torch.arange(6.0) * 0.5 - 1.0).mean())), "b": pytest.approx(1.25)}


def test_forgetting_violation_takes_the_old_models_correctness_now():
    rows = [{"x": float(i)} for i in (-2, -1, 1, 2)]

    def correct(model, batch):  # right when the scaled value is positive
        return (torch.as_tensor(batch["x"]).float() * model.w > 0).float()

    old = Scale(1.0)
    violation = forgetting_violation(old, {"a": rows}, correct, rate=0.25)
    old.w.data.fill_(-1.0)  # the old model changed after the call: its correctness was taken before
    assert violation(Scale(1.0)) == pytest.approx(0.0 - 0.25)  # nothing forgotten
    assert violation(Scale(-1.0)) == pytest.approx(0.5 - 0.25)  # both rows right before are wrong now
