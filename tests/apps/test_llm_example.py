"""The tiny-LM example (recipes/llm_tiny_example.py, ``hf-constrained llm-example``) runs end to
end on a few steps, and its exact-match accuracy (one teacher-forced pass) agrees with step-by-step greedy decoding."""

import dataclasses
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
    assert set(saved["summary"]["goals"]) == {"unconstrained_forgets_some_old_task",
                                              "hinge_learns_the_new_task_in_1_of_1_seeds",
                                              "hinge_certified_in_1_of_1_seeds"}
    # what a reproduction checks first: the old model's weights, and what the numbers depend on
    assert len(saved["old_model_sha256"]) == 64 and saved["environment"]["torch_threads"] == 1
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
    from hf_constrained import Certification, Constraint
    from hf_constrained.non_forgetting import ReferenceLossDataset
    from hf_constrained.safety.split_checks import check_certification_splits

    tokenizer = ex.char_tokenizer()
    cfg = ex.ExampleArguments(constraint_rows=64, held_out_rows=64, certify_rows=64)
    held_out, constraint_rows = ex.data_splits(tokenizer, cfg)
    certify = ex.certification_rows(tokenizer, cfg)["add"]
    texts = {tuple(r) for r in constraint_rows["add"]["input_ids"]}
    assert any(tuple(certify[i]["input_ids"]) in texts for i in range(len(certify)))  # same text, other draw
    wrapped = ReferenceLossDataset(certify, [0.0] * len(certify))  # the reference pass keeps the names
    assert wrapped.row_identities() == [f"add/certify/{i}" for i in range(64)]
    c = Constraint(name="add", row_fn=lambda m, b: b, dataset=constraint_rows["add"], eval_dataset=held_out["add"],
                   certify=Certification(dataset=wrapped, value_range=(0, 1)))
    assert set(check_certification_splits([c])) == {"add"}
    c.certify = dataclasses.replace(c.certify, dataset=constraint_rows["add"].select(range(5)))
    with pytest.raises(ValueError, match="also appear"):
        check_certification_splits([c])
    with pytest.raises(ValueError, match="--forget_tolerance"):
        ex.ExampleArguments(forget_tolerance=1.5)


def test_flags_that_cannot_work_are_errors_naming_the_flag():
    with pytest.raises(ValueError, match="--constraint_proxy_indicator needs --certify_rows"):
        ex.parse(["--certify_rows", "0"])  # the default proxy indicator follows the certificate's statistic
    assert ex.parse(["--certify_rows", "0", "--constraint_proxy_indicator", "false"]).certify_rows == 0
    with pytest.raises(ValueError, match="--constraint_indicator_fraction must be in"):
        ex.parse(["--constraint_indicator_fraction", "1"])
    with pytest.raises(ValueError, match="--constraint_margin"):
        ex.parse(["--constraint_margin", "-0.1"])
    with pytest.raises(ValueError, match="--threads"):
        ex.parse(["--threads", "0"])
    with pytest.raises(ValueError, match="--workers"):
        ex.parse(["--workers", "0"])
    with pytest.raises(ValueError, match="--per_device_train_batch_size must be >= 1, got 0"):
        ex.parse(["--per_device_train_batch_size", "0"])
    with pytest.raises(ValueError, match="--warmup_steps"):
        ex.parse(["--warmup_steps", "500"])  # as long as the run (--max_steps 500): no step at the full rate
    cfg = ex.parse(["--constraint_indicator_fraction", "0.25", "--constraint_margin", "0.05"])
    assert ex._estimation_args(cfg, "hinge") == {"constraint_indicator_fraction": 0.25,
                                                 "constraint_indicator_batch_size": None,
                                                 "constraint_proxy_indicator": True, "constraint_margin": 0.05}
    assert ex._estimation_args(ex.parse(["--constraint_indicator_batch_size", "3"]), "hinge")[
        "constraint_indicator_batch_size"] == 3
    with pytest.raises(ValueError, match="--constraint_indicator_batch_size needs --constraint_indicator_fraction"):
        ex.parse(["--constraint_indicator_batch_size", "3", "--constraint_indicator_fraction", "0",
                  "--constraint_proxy_indicator", "false"])
    assert ex._estimation_args(cfg, "none") == {}  # the unconstrained run has no estimates
    same_rows = ex.parse(["--constraint_indicator_fraction", "0"])  # the proxy on the gradient's own rows
    assert ex._estimation_args(same_rows, "hinge")["constraint_indicator_fraction"] is None
    assert ex._estimation_args(same_rows, "hinge")["constraint_proxy_indicator"] is True
    paper = ex.parse(["--constraint_indicator_fraction", "0", "--constraint_proxy_indicator", "false"])
    assert ex._estimation_args(paper, "hinge")["constraint_indicator_fraction"] is None  # 0: one split


def _run(seed, penalty, certified, new_acc, old_acc=0.9, h=0.1):
    forgotten = {f"non_forgetting/{t}": 0.1 for t in ex.OLD_TASKS}
    held = {t: {"accuracy": old_acc, "loss": 0.1} for t in ex.OLD_TASKS}
    held[ex.NEW_TASK] = {"accuracy": new_acc, "loss": 0.1}
    return {"penalty": penalty, "seed": seed, "held_out": held,
            "h_held_out": {f"non_forgetting/{t}": h for t in ex.OLD_TASKS},
            "certificate": {"certified": certified, "forgotten": forgotten, "largest_bound": 0.3 if certified else 0.5}}


@pytest.mark.parametrize("hits, met", [(4, True), (3, False)])
def test_goals_over_seeds_need_four_of_five(hits, met):
    """The constrained run's goals are met in at least 80% of the seeds: 4 of 5 meet them, 3 of 5 do not."""
    cfg = ex.ExampleArguments(seeds=[0, 1, 2, 3, 4])
    old = {t: {"accuracy": 1.0, "loss": 0.0} for t in (*ex.OLD_TASKS, ex.NEW_TASK)}
    runs = [_run(s, "none", False, 1.0, old_acc=0.0, h=5.0) for s in range(5)]
    runs += [_run(s, "hinge", s < hits, 0.95 if s < hits else 0.5, old_acc=0.9 - 0.01 * s) for s in range(5)]
    summary = ex.summarize(old, runs, cfg)
    assert summary["goals"] == {"unconstrained_forgets_some_old_task": True,
                                "hinge_learns_the_new_task_in_4_of_5_seeds": met,
                                "hinge_certified_in_4_of_5_seeds": met}
    assert summary["certificate"]["hinge"]["seeds_certified"] == hits
    row = summary["per_seed"]["hinge"]["4"]
    assert row["worst_old_accuracy_change"] == pytest.approx(0.9 - 0.04 - 1.0)
    assert summary["worst_old_accuracy_change"]["hinge"]["worst"] == pytest.approx(-0.14)
    table = ex.format_per_seed(summary, cfg)
    assert table.count("CERTIFIED") == hits and "-14.0 pts" in table
    assert [ex.seeds_needed(n) for n in (1, 3, 5, 10)] == [1, 3, 4, 8]


def _tiny_old_model(path, steps=6):
    cfg = ex.ExampleArguments(old_steps=steps, old_rows=40, hidden=16, layers=1)
    torch.set_num_threads(1)
    ex.train_old_model(str(path), cfg)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path))


def test_the_old_model_is_trained_deterministically(tmp_path):
    """Two trainings of the old model give the same weights (the fingerprint the results record);
    the fingerprint sees a change of one weight and of the training."""
    a, b = _tiny_old_model(tmp_path / "a"), _tiny_old_model(tmp_path / "b")
    assert ex.model_fingerprint(a) == ex.model_fingerprint(b)
    with torch.no_grad():
        next(b.parameters()).view(-1)[0] += 1e-6
    assert ex.model_fingerprint(a) != ex.model_fingerprint(b)
    assert ex.model_fingerprint(_tiny_old_model(tmp_path / "c", steps=7)) != ex.model_fingerprint(a)


def test_a_proxy_indicator_sees_the_old_models_exact_match_on_the_constraint_rows(tmp_path):
    """With --constraint_proxy_indicator every constraint row carries the old model's 0/1 exact match, and
    the indicator's rows evaluate the certificate's statistic (the share forgotten) against --forget_tolerance."""
    from hf_constrained.method.strategies import split_for_indicator
    from hf_constrained.non_forgetting import CORRECT_KEY, ForgottenRows

    model = _tiny_old_model(tmp_path / "old", steps=2)
    tokenizer = ex.AutoTokenizer.from_pretrained(str(tmp_path / "old"))
    collate = ex.PaddingCollator(tokenizer)
    cfg = ex.ExampleArguments(constraint_rows=24, held_out_rows=8, certify_rows=8, forget_tolerance=0.3)
    held_out, rows = ex.data_splits(tokenizer, cfg)
    constraints = ex.non_forgetting_constraints(model, ex.causal_lm_per_example_loss, rows, collate,
                                                certify_datasets=ex.certification_rows(tokenizer, cfg),
                                                correct=ex.causal_lm_per_example_correct,
                                                config=ex.NonForgettingConfig(forget_tolerance=0.3))
    ex.add_old_correctness(model, constraints, collate)
    for c, task in zip(constraints, ex.OLD_TASKS):
        batch = collate([rows[task][i] for i in range(len(rows[task]))])
        expected = ex.causal_lm_per_example_correct(model, batch).tolist()
        assert [c.dataset[i][CORRECT_KEY] for i in range(len(c.dataset))] == expected
        assert "reference_loss" in c.dataset[0]  # the gradient's surrogate still has its reference
    _, views = split_for_indicator(constraints, 0.5, seed=0, proxy=True)
    for view in views:
        assert isinstance(view.row_fn, ForgottenRows) and view.tolerance == 0.3
        batch = collate([view.dataset[i] for i in range(len(view.dataset))])
        assert float(view.row_fn(model, batch).sum()) == 0.0  # the old model forgets nothing


def test_the_committed_results_come_from_the_command_shown_beside_them():
    """benchmarks/results/llm_example.json stores the command the README and docs show and the settings that
    command parses to; the docs' per-seed table and the README's certificate line are the file's numbers."""
    import dataclasses
    import os
    import shlex

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "benchmarks", "results", "llm_example.json")) as f:
        saved = json.load(f)
    argv = shlex.split(saved["command"])
    assert argv[:2] == ["python", "recipes/llm_tiny_example.py"]
    cfg = ex.parse(argv[2:])
    assert dataclasses.asdict(cfg) == ex.stored_settings(saved["config"])
    assert cfg.json == "benchmarks/results/llm_example.json" and cfg.seeds == [100, 101, 102, 103, 104]
    # the old model is trained by the command itself: none, or a folder under outputs/, which a fresh clone lacks
    assert cfg.old_model is None or cfg.old_model.startswith("outputs/")
    readme = open(os.path.join(root, "docs", "benchmarks.md")).read()  # every measurement, with its command
    docs = open(os.path.join(root, "docs", "llm.md")).read()
    assert saved["command"] in readme and saved["command"] in docs
    assert ex.format_per_seed(saved["summary"], cfg) in docs
    assert ex.format_table(saved["summary"], cfg) in docs
    hinge = saved["summary"]["certificate"][cfg.constraint_penalty]
    assert f"certified in {hinge['seeds_certified']} of 5 seeds" in readme
    assert saved["old_model_sha256"][:12] in docs


@pytest.mark.slow
def test_each_run_certifies_as_its_own_first_look_and_the_anchor_is_only_the_constrained_runs(tmp_path,
                                                                                             monkeypatch):
    """Every run of the example is one simulated release certified once: two runs on the same certification rows
    are each the split's first look (level 0.9 delta under the default spending), and the user-level ledger is
    left alone. ``--replay_old`` (the default) or ``--kl_to_old`` adds its anchor to the constrained run, never to
    the unconstrained one; the two together are refused."""
    user_ledger = tmp_path / "user_ledger.json"
    monkeypatch.setenv("HF_CONSTRAINED_LEDGER", str(user_ledger))
    cfg = ex.parse(["--old_steps", "5", "--old_rows", "20", "--hidden", "16", "--max_steps", "2", "--new_rows",
                    "64", "--constraint_rows", "40", "--held_out_rows", "16", "--certify_rows", "16",
                    "--constraint_batch_size", "8", "--replay_old", "0", "--kl_to_old", "0.5"])
    old = str(tmp_path / "old")
    ex.train_old_model(old, cfg)
    runs = [ex.finetune(old, penalty, seed, cfg) for penalty, seed in (("hinge", 0), ("hinge", 1), ("none", 0))]
    replayed = ex.finetune(old, "hinge", 0, dataclasses.replace(cfg, kl_to_old=0.0, replay_old=0.5,
                                                                per_device_train_batch_size=16))
    for run in runs:
        assert set(run["certificate"]["looks"].values()) == {1}
        assert run["certificate"]["level"] == pytest.approx(0.9 * cfg.delta)
    assert not user_ledger.exists() and ex.os.environ["HF_CONSTRAINED_LEDGER"] == str(user_ledger)
    assert runs[0]["regulariser"] == {"name": "kl", "lam": 0.5, "rows_per_step": 32, "seed": 0}
    assert runs[2]["regulariser"] is None
    # the constrained run replays its constraints' own rows: one draw of old rows per step
    assert replayed["regulariser"] == {"name": "replay", "ratio": 0.5, "rows": "constraint_rows"}
    # --per_device_train_batch_size: the new-task rows of a step (the constraint rows come on top)
    assert replayed["new_rows_per_step"] == 16 and runs[0]["new_rows_per_step"] == 32
    assert ex.parse([]).replay_old == 0.5 and ex.parse([]).kl_to_old == 0.0  # the default anchor: replay
    with pytest.raises(ValueError, match="--kl_to_old"):
        ex.parse(["--replay_old", "0", "--kl_to_old", "-1"])
    with pytest.raises(ValueError, match="--replay_old 0.5 and --kl_to_old 2: the constrained run takes one anchor"):
        ex.parse(["--kl_to_old", "2"])
    with pytest.raises(ValueError, match=r"--replay_old is the old rows' share of the loss, in \[0, 1\); got 1.0"):
        ex.parse(["--replay_old", "1"])


def test_old_correct_rows_keep_exactly_the_rows_the_old_model_answers_by_greedy_decoding(tmp_path):
    """``--constraint_rows_kept old_correct``: each task keeps, in order, the constraint rows the old model answers
    exactly (checked here by step-by-step greedy decoding), and every method reads those rows."""
    cfg = ex.ExampleArguments(old_steps=300, old_rows=40, hidden=32, layers=1, old_lr=0.01, constraint_rows=24,
                              held_out_rows=8, certify_rows=8)
    torch.set_num_threads(1)
    ex.train_old_model(str(tmp_path / "old"), cfg)
    model = ex.AutoModelForCausalLM.from_pretrained(str(tmp_path / "old"))
    tokenizer = ex.AutoTokenizer.from_pretrained(str(tmp_path / "old"))
    _, rows = ex.data_splits(tokenizer, cfg)
    kept = ex.old_correct_rows(model, rows, ex.PaddingCollator(tokenizer))
    for task in ex.OLD_TASKS:
        answered = [r for r in rows[task] if _greedy_exact(model, [r], tokenizer.eos_token_id) == 1.0]
        assert 0 < len(answered) < len(rows[task])  # the check sees a filter: some rows go, some stay
        assert [r["input_ids"] for r in kept[task]] == [r["input_ids"] for r in answered]
    trainer, _ = ex.build_trainer(str(tmp_path / "old"), "hinge", 0, dataclasses.replace(
        cfg, constraint_rows_kept="old_correct", max_steps=1), str(tmp_path / "run"), ("replay", 0.5))
    assert [len(c.dataset) for c in trainer.constraints] == [len(kept[t]) for t in ex.OLD_TASKS]
    assert len(trainer.regularised.regulariser.dataset) == sum(len(kept[t]) for t in ex.OLD_TASKS)
    fresh = _tiny_old_model(tmp_path / "fresh", steps=1)  # answers nothing yet
    with pytest.raises(ValueError, match="task 'reverse': the old model answers none of its 24 rows right"):
        ex.old_correct_rows(fresh, rows, ex.PaddingCollator(tokenizer))
    with pytest.raises(ValueError, match="--constraint_rows_kept must be all or old_correct"):
        ex.ExampleArguments(constraint_rows_kept="some")
