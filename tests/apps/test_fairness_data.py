"""Loaders: Adult, COMPAS, any CSV, CheXpert's layout (synthetic folder) with an image backbone."""

import numpy as np
import pandas as pd
import pytest
import torch

from hf_constrained import ConstrainedTrainingArguments
from hf_constrained.fairness import (
    AUCConstrainedTrainer,
    TabularColumns,
    TabularSplit,
    collate_pairs,
    feature_names,
    load_adult,
    load_chexpert,
    load_compas,
    load_tabular_csv,
    objective_pairs,
    roc_fairness_constraints,
)
from hf_constrained.fairness.data import ImageRows


@pytest.fixture(scope="module")
def adult():
    return load_adult()


def test_adult_official_splits_groups_labels(adult):
    # 30,162 complete training rows (official adult.data minus rows with '?'), 15,060 complete test rows
    assert len(adult["train"]) + len(adult["validation"]) == 30162
    assert len(adult["test"]) == 15060
    assert len(adult["validation"]) == pytest.approx(0.2 * 30162, abs=3)
    tr = TabularSplit.from_dataset(adult["train"])
    te = TabularSplit.from_dataset(adult["test"])
    assert 0.23 < tr.label.mean() < 0.26 and 0.23 < te.label.mean() < 0.26  # >50K rate
    assert 0.66 < tr.group.mean() < 0.69  # share of men
    names = feature_names(adult)
    assert len(names) == tr.features.shape[1] and "sex=Female" in names and "fnlwgt" not in names
    # standardisation fitted on train only: train numeric columns are exactly centred, test ones are not
    age = names.index("age")
    assert abs(tr.features[:, age].mean()) < 1e-4 and abs(tr.features[:, age].std() - 1) < 1e-3
    assert abs(te.features[:, age].mean()) > 1e-4
    # the group attribute is the sex column: its one-hot agrees with `group`
    assert np.array_equal(tr.features[:, names.index("sex=Male")].astype(int), tr.group)


def test_validation_split_is_seeded_and_independent_of_training_seed():
    first, again = load_compas(), load_compas()  # same code path as Adult's validation split
    assert np.array_equal(np.asarray(again["validation"]["label"]), np.asarray(first["validation"]["label"]))
    a = TabularSplit.from_dataset(again["validation"]).features
    assert np.array_equal(a, TabularSplit.from_dataset(first["validation"]).features)
    other = TabularSplit.from_dataset(load_compas(split_seed=1)["validation"]).features
    assert a.shape == other.shape and not np.array_equal(a, other)


def test_compas_propublica_filter_and_race_groups():
    ds = load_compas()
    assert sum(len(ds[s]) for s in ("train", "validation", "test")) == 6172
    names = feature_names(ds)
    assert "decile_score" not in names and "race=Caucasian" in names
    tr = TabularSplit.from_dataset(ds["train"])
    assert np.array_equal(tr.features[:, names.index("race=Caucasian")].astype(int), tr.group)
    assert 0.4 < tr.label.mean() < 0.5
    dropped = feature_names(load_compas(drop_group_feature=True))
    assert not any(n.startswith("race=") for n in dropped)


def test_csv_loader_fits_on_train_only_and_checks_columns(tmp_path):
    rng = np.random.default_rng(0)
    n = 200
    train = pd.DataFrame({"x": rng.normal(size=n), "city": rng.choice(["a", "b"], n),
                          "g": rng.choice(["M", "F"], n), "y": rng.choice([0, 1], n)})
    test = pd.DataFrame({"x": rng.normal(loc=5.0, size=50), "city": ["c"] * 50,  # unseen category
                         "g": rng.choice(["M", "F"], 50), "y": rng.choice([0, 1], 50)})
    train.to_csv(tmp_path / "train.csv", index=False)
    test.to_csv(tmp_path / "test.csv", index=False)
    ds = load_tabular_csv(str(tmp_path / "train.csv"), TabularColumns(label_column="y", group_column="g",
                                                                      group_value="M"),
                          test_path=str(tmp_path / "test.csv"))
    names = feature_names(ds)
    assert names == ["x", "city=a", "city=b", "g=F", "g=M"]
    te = TabularSplit.from_dataset(ds["test"])
    tr = TabularSplit.from_dataset(ds["train"])
    # the unseen test category gets all-zero one-hots; test x is shifted by the TRAIN mean/std only
    assert (te.features[:, 1:3] == 0).all()
    assert te.features[:, 0].mean() > 3.0 and abs(tr.features[:, 0].mean()) < 1e-5
    assert np.array_equal(te.group, (test["g"] == "M").to_numpy().astype(int))
    with pytest.raises(ValueError, match="column 'label' not in the data"):
        load_tabular_csv(str(tmp_path / "train.csv"), TabularColumns(label_column="label", group_column="g"))
    with pytest.raises(ValueError, match="group value 'X' never occurs"):
        load_tabular_csv(str(tmp_path / "train.csv"),
                         TabularColumns(label_column="y", group_column="g", group_value="X"))
    with pytest.raises(FileNotFoundError):
        load_tabular_csv(str(tmp_path / "nope.csv"), TabularColumns(label_column="y", group_column="g"))


def _direct_features(train: pd.DataFrame, frame: pd.DataFrame, numeric, categorical) -> np.ndarray:
    """The preprocessing written out with pandas/numpy: (x - train mean) / train population std
    (a constant column only centred), then one 0/1 column per sorted train category."""
    cols = []
    for c in numeric:
        std = train[c].astype(float).std(ddof=0) or 1.0
        cols.append(((frame[c].astype(float) - train[c].astype(float).mean()) / std).to_numpy())
    for c in categorical:
        for v in sorted(train[c].astype(str).unique()):
            cols.append((frame[c].astype(str) == v).to_numpy().astype(float))
    return np.stack(cols, axis=1)


def test_column_transformer_features_equal_direct_pandas_computation():
    from hf_constrained.fairness.data import TabularPreprocessor

    rng = np.random.default_rng(3)
    n = 300
    train = pd.DataFrame({"x": rng.normal(2.0, 3.0, n), "k": rng.integers(0, 5, n), "const": np.full(n, 7.0),
                          "city": rng.choice(["b", "a", "c"], n), "code": rng.choice([10, 2], n)})
    other = pd.DataFrame({"x": rng.normal(size=40), "k": rng.integers(0, 9, 40), "const": np.full(40, 1.0),
                          "city": rng.choice(["a", "zz"], 40), "code": rng.choice([2, 3], 40)})  # unseen: zz, 3
    numeric, categorical = ["x", "k", "const"], ["city", "code"]
    prep = TabularPreprocessor(categorical, numeric).fit(train)
    assert prep.feature_names == ["x", "k", "const", "city=a", "city=b", "city=c", "code=10", "code=2"]
    for frame in (train, other):
        got = prep.transform(frame)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, _direct_features(train, frame, numeric, categorical), rtol=1e-6, atol=1e-6)


def test_shipped_loaders_features_equal_direct_pandas_computation():
    """COMPAS end to end: the split's features are the direct computation on its raw rows."""
    import hf_constrained.fairness.data as data

    raw = pd.read_csv(data._data_path("compas", "compas-scores-two-years.csv.gz"), compression="gzip")
    raw = raw[(raw["days_b_screening_arrest"] <= 30) & (raw["days_b_screening_arrest"] >= -30)
              & (raw["is_recid"] != -1) & (raw["c_charge_degree"] != "O") & (raw["score_text"] != "N/A")]
    raw = raw[data.COMPAS_FEATURES + ["two_year_recid"]].reset_index(drop=True)
    strata = raw["two_year_recid"].to_numpy() * 2 + (raw["race"] == "Caucasian").to_numpy()
    # the splits: sklearn's stratified train_test_split, test first (seed + 1), then validation (seed)
    from sklearn.model_selection import train_test_split

    rest, test = train_test_split(np.arange(len(raw)), test_size=0.2, stratify=strata, random_state=1)
    rest = np.sort(rest)
    train, val = train_test_split(np.arange(len(rest)), test_size=0.2, stratify=strata[rest], random_state=0)
    train_rows, val_rows = rest[np.sort(train)], rest[np.sort(val)]
    ds = load_compas()
    numeric = [c for c in data.COMPAS_FEATURES if pd.api.types.is_numeric_dtype(raw[c])]
    categorical = [c for c in data.COMPAS_FEATURES if c not in numeric]
    assert feature_names(ds)[:len(numeric)] == numeric
    fit_on = raw.iloc[train_rows]
    for split, rows in (("train", train_rows), ("validation", val_rows), ("test", np.sort(test))):
        got = TabularSplit.from_dataset(ds[split])
        np.testing.assert_allclose(got.features, _direct_features(fit_on, raw.iloc[rows], numeric, categorical),
                                   rtol=1e-5, atol=1e-5)
        assert np.array_equal(got.label, raw["two_year_recid"].to_numpy()[rows])
        # every label/group stratum keeps its share (to one row per stratum)
        for s in np.unique(strata):
            assert abs((strata[rows] == s).sum() - (strata == s).mean() * len(rows)) <= 2


def _chexpert_folder(root, n=16):
    from PIL import Image

    rng = np.random.default_rng(0)
    (root / "CheXpert-v1.0-small" / "train").mkdir(parents=True)
    rows = []
    for i in range(n):
        rel = f"CheXpert-v1.0-small/train/patient{i:05d}/study1/view1_frontal.jpg"
        (root / rel).parent.mkdir(parents=True)
        Image.fromarray(rng.integers(0, 255, size=(20, 20), dtype=np.uint8)).save(root / rel)
        rows.append({"Path": rel, "Sex": ["Male", "Female"][i % 2], "Age": 50, "Frontal/Lateral": "Frontal",
                     "AP/PA": "AP", "No Finding": None,
                     "Cardiomegaly": [1.0, 0.0, -1.0, None][(i // 2) % 4], "Edema": 0.0})
    rows.append({"Path": rows[0]["Path"], "Sex": "Unknown", "Cardiomegaly": 1.0})  # dropped: unknown sex
    pd.DataFrame(rows).to_csv(root / "CheXpert-v1.0-small" / "train.csv", index=False)
    return root / "CheXpert-v1.0-small"


def test_chexpert_layout_with_an_image_classification_backbone(tmp_path):
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    folder = _chexpert_folder(tmp_path)
    ds = load_chexpert(str(folder), label="Cardiomegaly", uncertain="ones")
    assert len(ds) == 16
    assert list(ds["label"][:8]) == [1, 1, 0, 0, 1, 1, 0, 0]  # 1, 0, -1 -> 1 (U-Ones), blank -> 0
    assert list(load_chexpert(str(folder), uncertain="zeros")["label"][:8]) == [1, 1, 0, 0, 0, 0, 0, 0]
    assert list(ds["group"][:4]) == [1, 0, 1, 0]
    with pytest.raises(ValueError, match="no column 'Pneumonia'"):
        load_chexpert(str(folder), label="Pneumonia")

    torch.manual_seed(0)
    proc = ViTImageProcessor(size={"height": 16, "width": 16})
    rows = ImageRows(ds, proc)
    assert rows.fetch([0, 3]).shape == (2, 3, 16, 16)
    model = ViTForImageClassification(ViTConfig(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=1,
                                                num_attention_heads=2, intermediate_size=16, num_labels=1))
    cons = roc_fairness_constraints(rows, thresholds=(0.0,), kappa=0.01)
    args = ConstrainedTrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, constraint_batch_size=2, max_steps=2,
        logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
        remove_unused_columns=False, penalty_beta=10.0)
    trainer = AUCConstrainedTrainer(model=model, args=args, constraints=cons, train_dataset=objective_pairs(rows),
                                    data_collator=collate_pairs)
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    values = trainer.evaluate_constraints(split="train")
    assert set(values) == {"tpr_gap@+0", "fpr_gap@+0"} and all(0 <= v <= 1 for v in values.values())

    (folder / "train" / "patient00003" / "study1" / "view1_frontal.jpg").unlink()
    with pytest.raises(FileNotFoundError, match="patient00003"):
        load_chexpert(str(folder))
