"""The global contrastive objective (Setting II) against a direct computation, and its estimators."""

import math

import pytest
import torch
from clip_synthetic import tiny_contrastive_setup

from hf_constrained import ConstrainedTrainingArguments
from hf_constrained.clip import ContrastiveConstrainedTrainer, contrastive_terms, gather_with_grad
from hf_constrained.clip.contrastive import (
    PreviousIterate,
    _first_occurrence,
    contrastive_surrogate,
    contrastive_value,
)
from hf_constrained.clip.data import CLIPCollator

T = 0.05


def _embeddings(n=7, d=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    img = torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1)
    txt = torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1)
    pos = torch.tensor([1, 0, 1, 1, 0, 0, 1], dtype=torch.bool)[:n]
    return img, txt, pos


def _direct(img, txt, pos, t):
    """Loops over anchors i (positives) and negatives j only, straight from the definition."""
    g_i, g_t = [], []
    for i in range(len(pos)):
        if not pos[i]:
            continue
        s_ii = img[i] @ txt[i]
        img_side = [torch.exp((img[i] @ txt[j] - s_ii) / t) for j in range(len(pos)) if not pos[j]]
        txt_side = [torch.exp((img[j] @ txt[i] - s_ii) / t) for j in range(len(pos)) if not pos[j]]
        g_i.append(torch.stack(img_side).mean())
        g_t.append(torch.stack(txt_side).mean())
    g_i, g_t = torch.stack(g_i), torch.stack(g_t)
    return g_i, g_t, t * (torch.log(g_i).mean() + torch.log(g_t).mean())


def test_terms_match_direct_computation():
    img, txt, pos = _embeddings()
    terms = contrastive_terms(img, txt, pos, T)
    g_i, g_t, value = _direct(img, txt, pos, T)
    assert terms.d_image.shape == (4, 3)  # positives x negatives: other positives are never negatives
    # exp(d/t) reaches ~1e8 here: compare with float32 relative precision
    torch.testing.assert_close(terms.g_image, g_i, rtol=1e-5, atol=0)
    torch.testing.assert_close(terms.g_text, g_t, rtol=1e-5, atol=0)
    torch.testing.assert_close(contrastive_value(terms, T), value, rtol=1e-5, atol=1e-6)


def test_surrogate_gradient_is_gradient_of_t_log_g_when_u_equals_g():
    img, txt, pos = _embeddings(seed=1)
    a = img.clone().requires_grad_(True)
    b = txt.clone().requires_grad_(True)
    terms = contrastive_terms(a, b, pos, T)
    contrastive_surrogate(terms, terms.g_image, terms.g_text).backward()
    a2 = img.clone().requires_grad_(True)
    b2 = txt.clone().requires_grad_(True)
    _direct(a2, b2, pos, T)[2].backward()
    torch.testing.assert_close(a.grad, a2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(b.grad, b2.grad, rtol=1e-4, atol=1e-5)


def test_surrogate_weights_by_the_estimator():
    """G_1 = mean_i mean_j exp(d_ij/t)/u_i grad d_ij: doubling u_i halves anchor i's gradient."""
    img, txt, pos = _embeddings(seed=2)
    grads = []
    for scale in (1.0, 2.0):
        a = img.clone().requires_grad_(True)
        terms = contrastive_terms(a, txt, pos, T)
        contrastive_surrogate(terms, terms.g_image * scale, terms.g_text * scale).backward()
        grads.append(a.grad)
    torch.testing.assert_close(grads[1][~pos].sum(0) * 2, grads[0][~pos].sum(0))


def test_fp32_exponentials_from_bf16_embeddings():
    img, txt, pos = _embeddings(seed=3)
    terms = contrastive_terms(img.bfloat16(), txt.bfloat16(), pos, T)
    assert terms.exp_image.dtype == torch.float32
    assert torch.isfinite(terms.exp_image).all() and torch.isfinite(terms.exp_text).all()


def test_gather_single_process_is_identity_and_first_occurrence():
    x = torch.randn(3, 2, requires_grad=True)
    assert gather_with_grad(x) is x
    assert _first_occurrence(torch.tensor([4, 2, 4, 7, 2])).tolist() == [True, True, False, True, False]


@pytest.fixture(scope="module")
def tiny():
    return tiny_contrastive_setup(24)


def _trainer(tiny, tmp_path, **kw):
    tok, model, data = tiny
    args = ConstrainedTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=3,
                                        learning_rate=1e-3, constraint_penalty="none", report_to=[], use_cpu=True,
                                        save_strategy="no", disable_tqdm=True, **kw)
    return ContrastiveConstrainedTrainer(model=model, args=args, train_dataset=data,
                                         data_collator=CLIPCollator(tokenizer=tok))


def test_previous_iterate_is_next_window_at_current_parameters(tiny, tmp_path):
    """get_batch_samples returns this window and stores g_i(w_t; B^{t+1}) of the next one."""
    tok, model, data = tiny
    trainer = _trainer(tiny, tmp_path)
    collate = CLIPCollator(tokenizer=tok)
    batches = [collate([data[i] for i in range(s, s + 8)]) for s in (0, 8, 16)]
    it = iter(batches)
    got, _ = trainer.get_batch_samples(it, 1, torch.device("cpu"))
    assert got[0] is batches[0]
    assert list(trainer._window_previous) == [None]  # first window: no previous iterate
    with torch.no_grad():
        terms, index = trainer._global_terms(model, batches[1])
    (entry,) = trainer._lookahead[2]
    assert entry.step == 1 and torch.equal(entry.index, index)
    torch.testing.assert_close(entry.image, terms.g_image, rtol=1e-5, atol=0)
    torch.testing.assert_close(entry.text, terms.g_text, rtol=1e-5, atol=0)
    got, _ = trainer.get_batch_samples(it, 1, torch.device("cpu"))
    assert got[0] is batches[1]  # the looked-ahead window comes next, nothing skipped
    assert list(trainer._window_previous) == [entry]  # handed to this window, not to a sample slot


def test_msvr_update_of_per_sample_estimators(tiny, tmp_path):
    """u <- (1-g)u + g*g_t + g'(g_t - g_prev) at the batch's positives (Algorithm 2, line 6)."""
    tok, model, data = tiny
    trainer = _trainer(tiny, tmp_path, objective_msvr_gamma=0.5, objective_msvr_gamma_prime=0.25)
    batch = CLIPCollator(tokenizer=tok)([data[i] for i in range(8)])
    est = trainer.objective_estimators["image"]
    trainer.in_training_step = True
    with torch.no_grad():
        terms, index = trainer._global_terms(model, batch)
    est.values[index] = 2.0
    est.visited[index] = True
    entry = PreviousIterate(0, index, torch.full_like(terms.g_image, 3.0), terms.g_text)
    trainer._window_previous.append(entry)
    trainer.compute_objective_loss(model, batch)
    expected = 0.5 * 2.0 + 0.5 * terms.g_image + 0.25 * (terms.g_image - 3.0)
    torch.testing.assert_close(est.values[index], expected, rtol=1e-5, atol=1e-6)
    assert not trainer._window_previous  # consumed once
    est.values[index] = 2.0
    trainer._window_previous.append(entry._replace(step=5))  # computed for another step: not used
    trainer.compute_objective_loss(model, batch)
    torch.testing.assert_close(est.values[index], 0.5 * 2.0 + 0.5 * terms.g_image, rtol=1e-5, atol=1e-6)
    untouched = torch.ones(len(data), dtype=torch.bool)
    untouched[index] = False
    assert not est.visited[untouched].any()  # only positives of the batch are visited


def test_short_training_run_updates_estimators_and_saves_state(tiny, tmp_path):
    trainer = _trainer(tiny, tmp_path)
    trainer.train()
    visited = trainer.objective_estimators["text"].visited
    pos = torch.tensor([r["is_positive"] for r in tiny[2].rows])
    assert visited[pos].all() and not visited[~pos].any()
    loss = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert all(math.isfinite(v) for v in loss)
    state = trainer.constraint_state_dict()
    assert state["objective"]["image"]["values"].shape == (len(tiny[2]),)


def test_objective_estimators_travel_with_the_checkpoint_state(tiny, tmp_path):
    trainer = _trainer(tiny, tmp_path)
    trainer.train()
    state = trainer.constraint_state_dict()
    fresh = _trainer(tiny, tmp_path / "fresh")
    fresh.load_constraint_state_dict(state)
    for side in ("image", "text"):
        torch.testing.assert_close(fresh.objective_estimators[side].values, trainer.objective_estimators[side].values)
        assert torch.equal(fresh.objective_estimators[side].visited, trainer.objective_estimators[side].visited)


def test_batch_without_required_keys_is_a_clear_error(tiny, tmp_path):
    tok, model, data = tiny
    trainer = _trainer(tiny, tmp_path)
    batch = CLIPCollator(tokenizer=tok)([data[i] for i in range(4)])
    del batch["is_positive"]
    with pytest.raises(KeyError, match="is_positive"):
        trainer.compute_objective_loss(model, batch)


def test_half_positive_batches(tiny, tmp_path):
    from hf_constrained.clip.contrastive import HalfPositiveSampler

    sampler = HalfPositiveSampler([True, False, False, False, False, True, False], seed=0)
    order = list(sampler)
    assert len(order) == 10 and sorted(set(order[1::2])) == [1, 2, 3, 4, 6] and set(order[0::2]) == {0, 5}
    assert list(sampler) != order  # a fresh shuffle next epoch
    trainer = _trainer(tiny, tmp_path)
    trainer.half_positive_batches = True
    batches = list(trainer.get_train_dataloader())
    assert all(int(b["is_positive"].sum()) == 4 for b in batches)  # 8 rows per batch: 4 positives
    with pytest.raises(ValueError, match="both kinds"):
        HalfPositiveSampler([True, True])


@pytest.mark.parametrize("accumulation", [1, 2])
def test_previous_iterate_matches_direct_recomputation_on_consecutive_windows(tiny, tmp_path, accumulation):
    """Every MSVR correction of step t uses g_i(w_{t-1}; B^t) recomputed directly: each batch
    of window t evaluated at the parameters of step t-1, also for a sample that sits in two
    consecutive windows or twice in one window (half-positive batches cycle the positives;
    Algorithm 2, line 6)."""
    import copy

    tok, model, data = tiny
    model = copy.deepcopy(model)
    calls = 8  # 4 batches an epoch: two epochs
    args = ConstrainedTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8,
                                        max_steps=calls // accumulation, gradient_accumulation_steps=accumulation,
                                        learning_rate=5e-3, constraint_penalty="none", report_to=[], use_cpu=True,
                                        save_strategy="no", disable_tqdm=True, objective_msvr_gamma=0.5,
                                        objective_msvr_gamma_prime=0.25, seed=3)
    trainer = ContrastiveConstrainedTrainer(model=model, args=args, train_dataset=data, half_positive_batches=True,
                                            data_collator=CLIPCollator(tokenizer=tok))
    steps = []  # per batch: step, batch, parameters w_t, positives' indices, previous passed to the update
    est = trainer.objective_estimators["image"]
    original_update, original_loss = est.update, trainer.compute_objective_loss

    def loss_spy(m, inputs, *a, **kw):
        steps.append({"step": trainer.state.global_step, "batch": inputs,
                      "params": {k: v.detach().clone() for k, v in m.state_dict().items()}})
        return original_loss(m, inputs, *a, **kw)

    def update_spy(index, current, previous=None):
        steps[-1]["index"], steps[-1]["previous"] = index.clone(), None if previous is None else previous.clone()
        return original_update(index, current, previous)

    trainer.compute_objective_loss, est.update = loss_spy, update_spy
    trainer.train()
    assert [s["step"] for s in steps] == [c // accumulation for c in range(calls)]
    windows_per_epoch = 4 // accumulation
    # the case under test: some positive sits in two consecutive batches of one epoch
    repeated = [c for c in range(1, calls)
                if c % 4 and set(steps[c]["index"].tolist()) & set(steps[c - 1]["index"].tolist())]
    assert repeated, "the sampler produced no sample in consecutive batches; change the seed"
    probe = copy.deepcopy(model)
    for c in range(calls):
        t, previous = steps[c]["step"], steps[c]["previous"]
        if t % windows_per_epoch == 0:  # first window of an epoch: no look-ahead value, correction dropped
            assert previous is None or torch.isnan(previous).all()
            continue
        assert previous is not None, f"batch {c} (step {t}): correction dropped"
        probe.load_state_dict(steps[(t - 1) * accumulation]["params"])  # w_{t-1}
        with torch.no_grad():
            terms, index = trainer._global_terms(probe, steps[c]["batch"])
        keep = _first_occurrence(index)
        assert torch.equal(index[keep], steps[c]["index"])
        torch.testing.assert_close(previous, terms.g_image[keep], rtol=1e-4, atol=1e-6,
                                   msg=f"batch {c} (step {t}): previous-iterate value is not g_i(w_(t-1); B^t)")
