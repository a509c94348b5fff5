"""The tiny-LM example (recipes/llm_tiny_example.py, ``hf-constrained llm-example``) runs end to
end on a few steps, and its exact-match accuracy (one teacher-forced pass) agrees with step-by-step greedy decoding."""

import json

import pytest
import torch

from hf_constrained.cli import main
from hf_constrained.recipes import llm_tiny_example as ex


def _greedy_exact(model, rows, eos_id):
    hits = 0
    with torch.no_grad():
        for r in rows:
            n_prompt = sum(1 for t in r["labels"] if t == -100)
            ids = list(r["input_ids"][:n_prompt])
            target = list(r["input_ids"][n_prompt:])
            while len(ids) < n_prompt + len(target):
                nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
                ids.append(nxt)
                if nxt == eos_id:
                    break
            hits += ids[n_prompt:] == target
    return hits / len(rows)


@pytest.mark.slow
def test_example_runs_and_exact_match_is_greedy_decoding(tmp_path):
    out = tmp_path / "result.json"
    # through the command line, with the flag names every recipe shares
    assert main(["llm-example", "--seeds", "0", "--old_steps", "40", "--old_rows", "100", "--hidden", "32",
                 "--max_steps", "4", "--new_rows", "64", "--constraint_rows", "32", "--held_out_rows", "16",
                 "--certify_rows", "20", "--forget_tolerance", "0.3",
                 "--constraint_penalty", "hinge", "--penalty_beta", "5", "--old_model", str(tmp_path / "old"),
                 "--json", str(out), "--workers", "1"]) == 0
    saved = json.loads(out.read_text())
    assert set(saved["summary"]["goals"]) == {"unconstrained_forgets_some_old_task", "both_learn_the_new_task",
                                              "hinge_keeps_every_old_task_within_tolerance",
                                              "hinge_certified_in_every_seed"}
    assert (saved["config"]["penalty_beta"], saved["config"]["max_steps"]) == (5.0, 4)
    assert {r["penalty"] for r in saved["runs"]} == {"none", "hinge"}
    for run in saved["runs"]:
        assert set(run["h_held_out"]) == {f"non_forgetting/{t}" for t in ex.OLD_TASKS}
        # per seed and method: the certificate of "at most 0.3 of each old task's examples forgotten"
        cert = run["certificate"]
        assert cert["num_rows"] == {f"non_forgetting/{t}": 20 for t in ex.OLD_TASKS}
        assert cert["certified"] == (cert["largest_bound"] <= 0.3)
        assert cert["largest_bound"] == max(cert["upper_bounds"].values()) >= 1 - 0.05 ** (1 / 20) - 1e-9
    for method in ("none", "hinge"):
        summary = saved["summary"]["certificate"][method]
        assert summary["per_seed"] == {"0": next(r["certificate"]["certified"] for r in saved["runs"]
                                                 if r["penalty"] == method)}
    # the teacher-forced exact match equals greedy decoding, row by row in aggregate
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "old")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "old").eval()
    collate = ex.PaddingCollator(tokenizer)
    for task in ex.OLD_TASKS:
        rows = ex.task_data(task, 24, 5, tokenizer)
        assert ex.exact_match(model, rows, collate) == _greedy_exact(model, rows, tokenizer.eos_token_id)
        # the certificate's per-row statistic is the same exact match
        batch = collate([rows[i] for i in range(len(rows))])
        correct = ex.causal_lm_per_example_correct(model, batch)
        assert float(correct.mean()) == ex.exact_match(model, rows, collate)


def test_certification_rows_are_independent_draws_named_by_their_draw():
    """The add task has 100 problems, so fresh draws repeat training rows' text; the certification rows are
    named by their draw (not their text) and the trainer accepts them, while a copied training row is refused."""
    from hf_constrained.non_forgetting import ReferenceLossDataset
    from hf_constrained.safety.splits import check_certification_splits
    from hf_constrained import Constraint

    tokenizer = ex.char_tokenizer()
    cfg = ex.ExampleArguments(constraint_rows=64, held_out_rows=64, certify_rows=64)
    held_out, constraint_rows = ex.data_splits(tokenizer, cfg)
    certify = ex.certification_rows(tokenizer, cfg)["add"]
    texts = {tuple(r) for r in constraint_rows["add"]["input_ids"]}
    assert any(tuple(certify[i]["input_ids"]) in texts for i in range(len(certify)))  # same text, other draw
    wrapped = ReferenceLossDataset(certify, [0.0] * len(certify))  # the reference pass keeps the names
    assert wrapped.row_identities() == [f"add/certify/{i}" for i in range(64)]
    c = Constraint(name="add", row_fn=lambda m, b: b, dataset=constraint_rows["add"], eval_dataset=held_out["add"],
                   certify_dataset=wrapped, value_range=(0, 1))
    assert set(check_certification_splits([c])) == {"add"}
    c.certify_dataset = constraint_rows["add"].select(range(5))
    with pytest.raises(ValueError, match="also appear"):
        check_certification_splits([c])
    with pytest.raises(ValueError, match="--forget_tolerance"):
        ex.ExampleArguments(forget_tolerance=1.5)
