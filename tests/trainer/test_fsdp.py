"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on two CPU processes (gloo), through the path users take.

``accelerate launch --config_file recipes/accelerate_configs/fsdp.yaml --num_processes 2
--mixed_precision no`` (the shipped config; ``use_cpu=True`` in the training arguments, as the
DDP test does) runs ``tests/distributed/run_fsdp_check.py``: the tiny constrained set-up of
``scale_tiny`` with 4 objective rows and 3 constraint rows per process, its two linear layers
sharded (TRANSFORMER_BASED_WRAP over ``_no_split_modules``). Asserted:

* the run was FSDP and the parameters were sharded (each rank held half of every tensor);
* both ranks hold the same gathered parameters and estimators, and they match one process on the
  same global batches (8 objective rows, 6 constraint rows) within 1e-5 (absolute; the estimates
  and parameters of float32 runs whose reductions are summed in another order; training moves the
  parameters by far more);
* stopped after step 3's sharded checkpoint (``pytorch_model_fsdp_0/*.distcp``, no full weights)
  and resumed in a fresh trainer to step 6, both ranks end bitwise where the straight run ends;
* a run with certification splits: ``save_model`` writes the full (gathered) weights, equal to the
  gathered parameters; ``finish_run``'s certificate and the gate agree with one process (same
  certified bounds, same verdict, the gate opens on both) and the held-out values match within 1e-5.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fsdp_tiny import certified_trainer
from launch_once import free_port, launch_once
from safetensors.torch import load_file
from scale_tiny import TinyClassifier, make_trainer, snapshot

from hf_constrained.safety import finish_run

HERE = Path(__file__).resolve().parents[1]  # tests/
CONFIGS = HERE.parent / "recipes" / "accelerate_configs"
STEPS = 6
TOL = 1e-5




def _launch(out: Path) -> None:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "fsdp.yaml"),
           "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(free_port()),
           str(HERE / "distributed" / "run_fsdp_check.py"), "--out", str(out), "--steps", str(STEPS)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"accelerate launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = launch_once(tmp_path_factory, "scale_fsdp", _launch)
    loaded = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    loaded[0]["out"] = out
    return loaded


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    trainer = make_trainer(str(tmp_path_factory.mktemp("fsdp_single")), max_steps=STEPS,
                           per_device_train_batch_size=8, constraint_batch_size=6)
    trainer.train()
    return snapshot(trainer)


def _close(got: dict, want: dict) -> None:
    assert got["streams"] == want["streams"]
    assert torch.equal(got["estimator_visited"], want["estimator_visited"])
    torch.testing.assert_close(got["estimator_values"], want["estimator_values"], rtol=0, atol=TOL)
    for name, p in want["params"].items():
        torch.testing.assert_close(got["params"][name], p, rtol=0, atol=TOL)


@pytest.mark.slow  # starts processes
def test_the_run_was_sharded(ranks):
    for r in ranks:
        s = r["straight"]
        assert s["distributed_type"] == "DistributedType.FSDP" and s["is_fsdp_enabled"]
        assert s["num_processes"] == 2 and s["global_step"] == STEPS
        assert s["model_class"].startswith("FSDP")
        assert s["sharded"] and all(s["sharded"].values()), s["sharded"]


@pytest.mark.slow  # starts processes
def test_fsdp_matches_one_process_on_the_same_global_batch(ranks, one_process):
    r0, r1 = (r["straight"] for r in ranks)
    assert torch.equal(r0["estimator_values"], r1["estimator_values"])
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name
    _close(r0, one_process)
    torch.manual_seed(1234)  # make_trainer's initialisation: the comparison is not vacuous
    start = TinyClassifier()
    moved = max((p.detach() - one_process["params"][n]).abs().max().item() for n, p in start.named_parameters())
    assert moved > 100 * TOL


@pytest.mark.slow  # starts processes
def test_resume_from_a_sharded_checkpoint_is_exact(ranks):
    files = ranks[0]["checkpoint_files"]
    assert any(f.startswith("pytorch_model_fsdp_0/") and f.endswith(".distcp") for f in files), files
    assert "constraint_state.pt" in files
    assert not any(f.endswith(".safetensors") for f in files), files  # sharded, not gathered
    for r in ranks:
        straight, resumed = r["straight"], r["resumed"]
        assert resumed["global_step"] == STEPS
        assert torch.equal(resumed["estimator_values"], straight["estimator_values"])
        assert torch.equal(resumed["estimator_visited"], straight["estimator_visited"])
        assert resumed["streams"] == straight["streams"]
        for name, p in straight["params"].items():
            assert torch.equal(resumed["params"][name], p), name


@pytest.mark.slow  # starts processes
def test_certificate_report_and_gate_on_the_gathered_model(ranks, tmp_path, monkeypatch):
    # the one-process run below is another scenario on the same certification rows: a ledger of its own,
    # so that it is the first look, as the FSDP run's certificate was
    monkeypatch.setenv("HF_CONSTRAINED_LEDGER", str(tmp_path / "single-ledger.json"))
    out = ranks[0]["out"]
    c0, c1 = (r["certified"] for r in ranks)
    # the released weights are the full, gathered ones
    assert "model.safetensors" in c0["saved_files"] and "safety_report.json" in c0["saved_files"]
    saved = load_file(str(out / "certified" / "model.safetensors"))
    assert set(saved) == set(c0["params"])
    for name, p in c0["params"].items():
        assert torch.equal(saved[name], p), name
        assert torch.equal(p, c1["params"][name]), name
    # one process on the same global batches: the same certificate, verdict and gate
    single = certified_trainer(str(tmp_path / "single"), max_steps=STEPS, per_device_train_batch_size=8,
                               constraint_batch_size=6)
    single.train()
    single.save_model()
    report = finish_run(single, old_model_values={c.name: 0.0 for c in single.constraints}, plots=False)
    for name, p in snapshot(single)["params"].items():
        torch.testing.assert_close(c0["params"][name], p, rtol=0, atol=TOL)
    assert c0["bounds"] == c1["bounds"] and set(c0["bounds"]) == {c.name for c in single.constraints}
    for name, bound in report.certified_bounds().items():
        assert c0["bounds"][name] == pytest.approx(bound, abs=1e-12), name
    assert c0["certified"] == c1["certified"] == report.certified
    single.safety.check_safe_to_push()  # raises when the gate refuses
    assert c0["gate"] == c1["gate"] == "open"
    got = {row["name"]: row for row in c0["report"]["constraints"]}
    for row in report.to_dict()["constraints"]:
        assert got[row["name"]]["value"] == pytest.approx(row["value"], abs=TOL), row["name"]


@pytest.mark.parametrize("version", ["1", "2"])
def test_fsdp_on_one_cpu_process_is_refused(tmp_path, monkeypatch, version):
    """One CPU process cannot shard: an FSDP request of either version is refused before training
    instead of training an unsharded model (version 2 shards only with several processes)."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", version)
    with pytest.raises(ValueError, match="FSDP was requested .* without FSDP .*fsdp_version: 2"):
        make_trainer(str(tmp_path / "fsdp"))


@pytest.mark.slow  # starts processes
def test_llm_recipe_under_fsdp_on_two_cpu_processes(tmp_path):
    """The LLM recipe, launched as users launch it with the shipped fsdp.yaml: trains sharded (the
    trainer logs FSDP2), and saves a full model (every tensor at its configured shape) that loads with
    ``from_pretrained``, next to its results and safety report."""
    import json

    from transformers import AutoModelForCausalLM

    from hf_constrained.recipes.tiny_lm import char_tokenizer, tiny_causal_lm

    tok = char_tokenizer()
    model = tiny_causal_lm(len(tok), "llama", hidden_size=32, layers=2, heads=2)
    model.save_pretrained(tmp_path / "llama")
    tok.save_pretrained(tmp_path / "llama")
    words = ["abc", "hello", "xyz", "qrs", "mnop", "dog", "cat", "tree", "sun", "moon", "star", "leaf"]
    data = {"sort": [{"prompt": f"sort:{w}=", "completion": "".join(sorted(w))} for w in words],
            "reverse": [{"prompt": f"rev:{w}=", "completion": w[::-1]} for w in words],
            "copy": [{"text": f"cp:{w}={w}"} for w in words]}
    for name, rows in data.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "fsdp.yaml"),
           "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(free_port()),
           str(HERE.parent / "recipes" / "llm_non_forgetting.py"),
           "--model_name_or_path", str(tmp_path / "llama"), "--dataset_name", str(tmp_path / "sort.jsonl"),
           "--protected_datasets", f"reverse={tmp_path / 'reverse.jsonl'}", str(tmp_path / "copy.jsonl"),
           "--output_dir", str(out), "--max_steps", "2", "--per_device_train_batch_size", "4",
           "--learning_rate", "1e-2", "--constraint_batch_size", "3", "--eval_fraction", "0.25", "--use_cpu", "true",
           "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true", "--seed", "0",
           "--reference_batch_size", "4"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=str(HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"accelerate launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "FSDP2 on 2 CPU processes" in proc.stdout + proc.stderr
    results = json.loads((out / "llm_results.json").read_text())
    assert results["num_processes"] == 2 and len(results["safety_report"]["constraints"]) == 2
    saved = AutoModelForCausalLM.from_pretrained(out)
    for name, p in model.state_dict().items():
        assert saved.state_dict()[name].shape == p.shape, name
    assert any(not torch.equal(saved.state_dict()[n], p) for n, p in model.state_dict().items())  # it trained
