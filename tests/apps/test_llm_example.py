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
                 "--constraint_penalty", "hinge", "--penalty_beta", "5", "--old_model", str(tmp_path / "old"),
                 "--json", str(out), "--workers", "1"]) == 0
    saved = json.loads(out.read_text())
    assert set(saved["summary"]["goals"]) == {"unconstrained_forgets_some_old_task", "both_learn_the_new_task",
                                              "hinge_keeps_every_old_task_within_tolerance"}
    assert (saved["config"]["penalty_beta"], saved["config"]["max_steps"]) == (5.0, 4)
    assert {r["penalty"] for r in saved["runs"]} == {"none", "hinge"}
    for run in saved["runs"]:
        assert set(run["h_held_out"]) == {f"non_forgetting/{t}" for t in ex.OLD_TASKS}
    # the teacher-forced exact match equals greedy decoding, row by row in aggregate
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "old")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "old").eval()
    collate = ex.PaddingCollator(tokenizer)
    for task in ex.OLD_TASKS:
        rows = ex.task_data(task, 24, 5, tokenizer)
        assert ex.exact_match(model, rows, collate) == _greedy_exact(model, rows, tokenizer.eos_token_id)
