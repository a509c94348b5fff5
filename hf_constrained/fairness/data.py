"""Data for ROC-fairness training: Adult, COMPAS, any CSV, and CheXpert's layout.

Every tabular loader returns a :class:`datasets.DatasetDict` with splits ``train``,
``validation`` and ``test`` and columns

* ``features``: the preprocessed feature vector (float32): categorical columns one-hot
  encoded, numeric columns standardised (scikit-learn's ``ColumnTransformer`` with
  ``OneHotEncoder`` and ``StandardScaler``); both are fitted on the TRAIN split only and
  applied unchanged to validation and test;
* ``label``: 1 for the positive class, 0 otherwise;
* ``group``: 1 for group p (Adult: Male; COMPAS: Caucasian), 0 for group u.

The validation split is a fixed, seeded, label-and-group-stratified fraction of the
training data (scikit-learn's ``train_test_split(stratify=...)``) (``split_seed``, default 0, independent of the
training seed), so every method and training seed sees the same train / validation rows. The feature names are
kept in ``DatasetDict["train"].info.description`` as JSON and returned by
:func:`feature_names`.

The paper's groups and labels (paper section 5.1): Adult, sex
(male / female), income > 50K; COMPAS, race (Caucasian / non-Caucasian),
two_year_recid.

CheXpert (:func:`load_chexpert`): the CSV layout of the CheXpert release (``Path``,
``Sex`` and one column per finding with 1 / 0 / -1 / blank) and images on disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np
import pandas as pd
import torch

from ..extras import require_extra

require_extra("sklearn", "fairness", "the fairness data (Adult, COMPAS, CSV, CheXpert)")

from sklearn.compose import ColumnTransformer  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402
from sklearn.preprocessing import OneHotEncoder, StandardScaler  # noqa: E402

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

ADULT_COLUMNS = [
    "age", "workclass", "fnlwgt", "education", "education-num", "marital-status", "occupation",
    "relationship", "race", "sex", "capital-gain", "capital-loss", "hours-per-week", "native-country", "income",
]
COMPAS_FEATURES = [
    "sex", "age", "age_cat", "race", "juv_fel_count", "juv_misd_count", "juv_other_count", "priors_count",
    "c_charge_degree",
]
SPLITS = ("train", "validation", "test")
ROW_ID = "__hf_constrained_row_id"  # a temporary column: each raw row's file and line


def _data_path(*parts: str) -> str:
    return str(resources.files("hf_constrained").joinpath("data", *parts))


# --------------------------------------------------------------------------- preprocessing
@dataclass
class TabularPreprocessor:
    """One-hot for categorical columns, standardisation for numeric ones; fit on train only.

    A thin wrapper around scikit-learn's ``ColumnTransformer`` (``StandardScaler`` on the
    numeric columns, population std, a constant column kept centred and unscaled;
    ``OneHotEncoder`` on the categorical ones, compared as strings, categories sorted, a
    category unseen in train encoded as all zeros) that keeps the library's feature names
    (numeric names, then ``column=value``).
    """

    categorical: list[str]
    numeric: list[str]
    transformer: Optional[ColumnTransformer] = None

    def fit(self, df: pd.DataFrame) -> "TabularPreprocessor":
        if not self.categorical and not self.numeric:
            raise ValueError("no feature columns left after removing the label (and group) columns")
        parts = []
        if self.numeric:
            parts.append(("numeric", StandardScaler(), list(self.numeric)))
        if self.categorical:
            # no column is invented from test data: unseen categories become all zeros
            parts.append(("categorical", OneHotEncoder(handle_unknown="ignore", sparse_output=False,
                                                       dtype=np.float32), list(self.categorical)))
        self.transformer = ColumnTransformer(parts, sparse_threshold=0.0).fit(self._frame(df))
        return self

    def _frame(self, df: pd.DataFrame) -> pd.DataFrame:
        """Numeric columns as float, categorical ones as strings (so 1 and "1" are one category)."""
        return pd.DataFrame({**{c: df[c].astype(float) for c in self.numeric},
                             **{c: df[c].astype(str) for c in self.categorical}}, index=df.index)

    @property
    def categories(self) -> dict[str, list[str]]:
        """The categories of each categorical column, as fitted on train (sorted)."""
        if self.transformer is None:
            raise RuntimeError("TabularPreprocessor used before fit")
        if not self.categorical:
            return {}
        encoder = self.transformer.named_transformers_["categorical"]
        return {c: [str(v) for v in cats] for c, cats in zip(self.categorical, encoder.categories_)}

    @property
    def feature_names(self) -> list[str]:
        cats = self.categories
        return list(self.numeric) + [f"{c}={v}" for c in self.categorical for v in cats[c]]

    def transform(self, df: pd.DataFrame) -> np.ndarray:
        if self.transformer is None:
            raise RuntimeError("TabularPreprocessor.transform called before fit")
        return np.asarray(self.transformer.transform(self._frame(df)), dtype=np.float32)


def _stratified_split(strata: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices (keep, held_out), both sorted, with ``fraction`` of every stratum held out
    (scikit-learn's ``train_test_split(stratify=...)``, seeded)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"split fraction must be in (0, 1), got {fraction}")
    values, counts = np.unique(strata, return_counts=True)
    if counts.min() < 2:
        raise ValueError(f"cannot stratify the split: the label/group combination {values[counts.argmin()]} "
                         f"(label * 2 + group) has only {counts.min()} row")
    keep, held_out = train_test_split(np.arange(len(strata)), test_size=fraction, stratify=strata,
                                      random_state=seed)
    return np.sort(keep), np.sort(held_out)


def _binary(series: pd.Series, value: Any, what: str, column: str) -> np.ndarray:
    """1 where ``series == value`` (compared as stripped strings), with a clear error if absent."""
    as_str = series.astype(str).str.strip()
    target = str(value).strip()
    out = (as_str == target).to_numpy().astype(np.int64)
    if out.sum() == 0:
        raise ValueError(
            f"{what} value {value!r} never occurs in column {column!r} (values present: {sorted(as_str.unique())[:20]})"
        )
    return out


@dataclass(frozen=True)
class TabularColumns:
    """What a table's columns mean for ROC fairness: which is the label, which the group, which are features.

    Args:
        label_column, positive_label: ``label = 1`` where the column equals ``positive_label``.
        group_column, group_value: ``group = 1`` (group p) where the column equals ``group_value``.
        categorical_columns: one-hot columns (default: every non-numeric column).
        drop_columns: columns that are not features (ids, dates, leaks).
        drop_group_feature: leave the group column out of the features.
    """

    label_column: str
    group_column: str
    positive_label: Any = 1
    group_value: Any = 1
    categorical_columns: Optional[Sequence[str]] = None
    drop_columns: Sequence[str] = ()
    drop_group_feature: bool = False


def build_tabular_splits(train_df: pd.DataFrame, test_df: Optional[pd.DataFrame], columns: TabularColumns, *,
                         validation_fraction: float = 0.2, test_fraction: float = 0.2,
                         split_seed: int = 0) -> datasets.DatasetDict:
    """Preprocess raw frames into the ``train`` / ``validation`` / ``test`` DatasetDict.

    Args:
        train_df, test_df: raw frames; with ``test_df=None`` a seeded, stratified
            ``test_fraction`` of ``train_df`` becomes the test split.
        columns: what the columns mean (:class:`TabularColumns`).
        validation_fraction: fraction of the training rows held out for validation.
        split_seed: seed of the validation (and test) split, fixed across training seeds.
    """
    label_column, group_column = columns.label_column, columns.group_column
    positive_label, group_value = columns.positive_label, columns.group_value
    drop_columns, categorical_columns = columns.drop_columns, columns.categorical_columns
    for col in (label_column, group_column):
        if col not in train_df.columns:
            raise ValueError(f"column {col!r} not in the data; columns are {list(train_df.columns)}")
    # each row's identity: its file and line (rows with equal features are different people, and a
    # certification split must share no PERSON with the training data)
    frames = {"train": train_df.reset_index(drop=True).assign(
        **{ROW_ID: lambda d: [f"data:{i}" for i in range(len(d))]})}
    if test_df is not None:
        missing = [c for c in train_df.columns if c not in test_df.columns]
        if missing:
            raise ValueError(f"test data lacks columns {missing}")
        frames["test"] = test_df.reset_index(drop=True).assign(
            **{ROW_ID: lambda d: [f"test:{i}" for i in range(len(d))]})
    labels = {k: _binary(df[label_column], positive_label, "positive label", label_column) for k, df in frames.items()}
    groups = {k: _binary(df[group_column], group_value, "group", group_column) for k, df in frames.items()}
    if test_df is None:
        strata = labels["train"] * 2 + groups["train"]
        keep, held = _stratified_split(strata, test_fraction, split_seed + 1)
        df = frames["train"]
        frames = {"train": df.iloc[keep].reset_index(drop=True), "test": df.iloc[held].reset_index(drop=True)}
        labels = {"train": labels["train"][keep], "test": labels["train"][held]}
        groups = {"train": groups["train"][keep], "test": groups["train"][held]}
    keep, held = _stratified_split(labels["train"] * 2 + groups["train"], validation_fraction, split_seed)
    df = frames["train"]
    frames.update(train=df.iloc[keep].reset_index(drop=True), validation=df.iloc[held].reset_index(drop=True))
    labels.update(train=labels["train"][keep], validation=labels["train"][held])
    groups.update(train=groups["train"][keep], validation=groups["train"][held])

    excluded = set(drop_columns) | {label_column, ROW_ID} | ({group_column} if columns.drop_group_feature else set())
    feature_cols = [c for c in train_df.columns if c not in excluded]
    if categorical_columns is None:
        categorical = [c for c in feature_cols if not pd.api.types.is_numeric_dtype(frames["train"][c])]
    else:
        unknown = [c for c in categorical_columns if c not in feature_cols]
        if unknown:
            raise ValueError(f"categorical columns {unknown} are not feature columns {feature_cols}")
        categorical = list(categorical_columns)
    numeric = [c for c in feature_cols if c not in categorical]
    import datasets  # imported here so that training from cached arrays does not need it

    prep = TabularPreprocessor(categorical, numeric).fit(frames["train"])  # train only
    info = datasets.DatasetInfo(description=json.dumps({"feature_names": prep.feature_names}))
    out = {}
    for split in SPLITS:
        features = prep.transform(frames[split])
        out[split] = datasets.Dataset.from_dict(
            {"features": features, "label": labels[split], "group": groups[split],
             "row_id": frames[split][ROW_ID].tolist()}, info=info, split=split
        )
    return datasets.DatasetDict(out)


def feature_names(ds: datasets.Dataset | datasets.DatasetDict) -> list[str]:
    """Names of the columns of ``features`` (numeric first, then ``column=value`` one-hots)."""
    import datasets

    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"]
    return json.loads(ds.info.description)["feature_names"]


# --------------------------------------------------------------------------- shipped data sets
def load_adult(*, validation_fraction: float = 0.2, split_seed: int = 0,
               drop_group_feature: bool = False) -> datasets.DatasetDict:
    """UCI Adult with its official test split; label income > 50K, group p = Male (paper sec. 5.1).

    Rows with a missing value (``?``) are dropped; ``fnlwgt`` (a sampling weight) is not a feature.
    """
    def read(name: str, skip: int) -> pd.DataFrame:
        df = pd.read_csv(_data_path("adult", name), header=None, names=ADULT_COLUMNS, skiprows=skip,
                         sep=",", skipinitialspace=True, na_values="?", compression="gzip")
        df = df.dropna().reset_index(drop=True)
        df["income"] = df["income"].str.rstrip(".")  # the test file's labels end in a dot
        return df

    columns = TabularColumns(label_column="income", positive_label=">50K", group_column="sex", group_value="Male",
                             drop_columns=("fnlwgt",), drop_group_feature=drop_group_feature)
    return build_tabular_splits(read("adult.data.gz", 0), read("adult.test.gz", 1), columns,
                                validation_fraction=validation_fraction, split_seed=split_seed)


def load_compas(*, validation_fraction: float = 0.2, test_fraction: float = 0.2, split_seed: int = 0,
                drop_group_feature: bool = False) -> datasets.DatasetDict:
    """ProPublica COMPAS, filtered as in ProPublica's analysis; label two_year_recid, group p = Caucasian.

    No official test split exists: a seeded, stratified ``test_fraction`` is held out.
    Features: sex, age, age category, race, juvenile counts, priors, charge degree (not
    COMPAS's own decile score).
    """
    df = pd.read_csv(_data_path("compas", "compas-scores-two-years.csv.gz"), compression="gzip")
    df = df[(df["days_b_screening_arrest"] <= 30) & (df["days_b_screening_arrest"] >= -30)
            & (df["is_recid"] != -1) & (df["c_charge_degree"] != "O") & (df["score_text"] != "N/A")]
    df = df[COMPAS_FEATURES + ["two_year_recid"]].reset_index(drop=True)
    columns = TabularColumns(label_column="two_year_recid", positive_label=1, group_column="race",
                             group_value="Caucasian", drop_group_feature=drop_group_feature)
    return build_tabular_splits(df, None, columns, validation_fraction=validation_fraction,
                                test_fraction=test_fraction, split_seed=split_seed)


def load_tabular_csv(path: str, columns: TabularColumns, *, test_path: Optional[str] = None,
                     validation_fraction: float = 0.2, test_fraction: float = 0.2,
                     split_seed: int = 0) -> datasets.DatasetDict:
    """Any CSV with a label column and a group column (pandas reads ``.csv`` / ``.csv.gz``).

    ``columns`` (:class:`TabularColumns`): ``label = 1`` where ``label_column == positive_label``; ``group = 1``
    (group p) where ``group_column == group_value`` (both compared as strings). Without ``test_path`` a
    seeded, stratified ``test_fraction`` becomes test.

    The file is checked before anything is encoded (:func:`_read_checked_csv`): a stray
    string in an otherwise numeric column, an infinite value, or a label/group column that
    is entirely empty is an error naming the column, the row count and CSV line numbers;
    an all-empty feature column is dropped and rows with missing values are dropped, each
    with a warning naming the columns and counts; a label or group column with more than
    two values is binarised with a warning giving both sides' row counts.
    """
    label_column, group_column = columns.label_column, columns.group_column
    checks = dict(label_column=label_column, group_column=group_column, categorical_columns=columns.categorical_columns,
                  drop_columns=columns.drop_columns)
    train_df = _read_checked_csv(path, flag="--csv_path", **checks)
    test_df = _read_checked_csv(test_path, flag="--csv_test_path", **checks) if test_path else None
    for name, df in (("", train_df), (" (test)", test_df)):
        if df is None or label_column not in df or group_column not in df:
            continue  # build_tabular_splits names the missing column
        _log_binarised(df[label_column], columns.positive_label, label_column, f"label{name}")
        _log_binarised(df[group_column], columns.group_value, group_column, f"group{name}")
    return build_tabular_splits(train_df, test_df, columns, validation_fraction=validation_fraction,
                                test_fraction=test_fraction, split_seed=split_seed)


def _lines(rows: Sequence[int], limit: int = 5) -> str:
    """CSV line numbers of 0-based data rows (line 1 is the header)."""
    shown = ", ".join(str(int(r) + 2) for r in list(rows)[:limit])
    return shown + (f" and {len(rows) - limit} more" if len(rows) > limit else "")


def _read_checked_csv(path: str, *, label_column: str, group_column: str,
                      categorical_columns: Optional[Sequence[str]], drop_columns: Sequence[str],
                      flag: str = "--csv_path") -> pd.DataFrame:
    """Read ``path`` and check it column by column (see :func:`load_tabular_csv`); ``flag`` is the
    recipe flag that names the file (``--csv_path``, ``--csv_test_path``), for the error messages."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"CSV file {path!r} ({flag}) does not exist")
    try:
        df = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        raise ValueError(f"CSV file {path!r} ({flag}) is empty: it needs a header line naming the columns "
                         f"(at least {label_column!r} and {group_column!r}) and data rows") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as exc:
        why = " ".join(str(exc).split())
        raise ValueError(f"CSV file {path!r} ({flag}) cannot be read as CSV: {why}") from None
    if df.empty:
        raise ValueError(f"CSV file {path!r} ({flag}) has a header but no data rows")
    skip = set(drop_columns)
    declared_categorical = set(categorical_columns or ())
    empty = [c for c in df.columns if df[c].isna().all() and c not in skip]
    for col in (label_column, group_column):
        if col in empty:
            raise ValueError(f"{path}: column {col!r} is empty in all {len(df)} rows")
    if empty:
        logger.warning("%s: dropping column(s) %s: empty in all %d rows", path, empty, len(df))
        df = df.drop(columns=empty)
    for col in df.columns:
        if col in skip or col in (label_column, group_column):
            continue
        values = df[col]
        if not pd.api.types.is_numeric_dtype(values) and col not in declared_categorical:
            present = values.dropna()
            numeric = pd.to_numeric(present, errors="coerce")
            bad = present[numeric.isna()]
            if len(bad) and len(bad) <= len(present) // 2:  # mostly numbers: the strings are errors
                examples = ", ".join(f"line {int(i) + 2}: {v!r}" for i, v in list(bad.items())[:3])
                raise ValueError(
                    f"{path}: column {col!r} is numeric except {len(bad)} of {len(present)} rows ({examples}); fix "
                    "those values, or list the column in categorical_columns to one-hot encode it as text"
                )
            if not len(bad):
                df[col] = pd.to_numeric(values)
                values = df[col]
        if pd.api.types.is_numeric_dtype(values):
            inf_rows = np.flatnonzero(np.isinf(values.to_numpy(dtype=float, na_value=np.nan)))
            if len(inf_rows):
                raise ValueError(f"{path}: column {col!r} has {len(inf_rows)} infinite value(s) "
                                 f"(lines {_lines(inf_rows)}); replace or drop them")
    missing = df.drop(columns=[c for c in df.columns if c in skip]).isna()  # gaps in dropped columns do not matter
    dropped = int(missing.any(axis=1).sum())
    if dropped:
        per_column = {c: int(n) for c, n in missing.sum().items() if n}
        if dropped == len(df):
            raise ValueError(f"{path}: every one of the {len(df)} rows has a missing value (missing per column: "
                             f"{per_column}); drop the columns with many gaps (drop_columns) or fill them")
        logger.warning("%s: dropping %d of %d rows with missing values (missing per column: %s)",
                       path, dropped, len(df), per_column)
        df = df[~missing.any(axis=1)]
    return df.reset_index(drop=True)


def _log_binarised(series: pd.Series, value: Any, column: str, what: str) -> None:
    """Warn when a column with more than two values is turned into 1 (== value) / 0 (the rest)."""
    as_str = series.astype(str).str.strip()
    distinct = as_str.unique()
    if len(distinct) <= 2:
        return
    ones = int((as_str == str(value).strip()).sum())
    others = sorted(v for v in distinct if v != str(value).strip())
    logger.warning("%s column %r has %d values: %s = 1 for %r (%d rows), 0 for %s (%d rows)", what, column,
                   len(distinct), what.split()[0], value, ones, others[:10], len(series) - ones)


TABULAR_LOADERS: dict[str, Callable[..., datasets.DatasetDict]] = {"adult": load_adult, "compas": load_compas}


# --------------------------------------------------------------------------- arrays for training
@dataclass
class TabularSplit:
    """One split as arrays: ``features`` (n, d) float32, ``label`` and ``group`` (n,) int64, and
    optionally ``row_id`` (n,) strings, each row's place in the raw data (its identity)."""

    features: np.ndarray
    label: np.ndarray
    group: np.ndarray
    row_id: Optional[np.ndarray] = None

    @classmethod
    def from_dataset(cls, ds: datasets.Dataset) -> "TabularSplit":
        cols = ds.with_format("numpy")[:]  # one columnar read, not a row-by-row iteration
        row_id = np.asarray(cols["row_id"]).astype(str) if "row_id" in cols else None
        return cls(np.asarray(cols["features"], dtype=np.float32), np.asarray(cols["label"], dtype=np.int64),
                   np.asarray(cols["group"], dtype=np.int64), row_id)

    def __len__(self) -> int:
        return len(self.label)

    def subset(self, rows: Sequence[int] | np.ndarray) -> "TabularSplit":
        """The split restricted to ``rows``."""
        i = np.asarray(rows, dtype=np.int64)
        return TabularSplit(self.features[i], self.label[i], self.group[i],
                            None if self.row_id is None else self.row_id[i])

    def identities(self, rows: Sequence[int] | np.ndarray) -> list[str]:
        """The identity of each of ``rows``: its ``row_id``, else a hash of its features, label and group."""
        i = np.asarray(rows, dtype=np.int64)
        if self.row_id is not None:
            return [str(r) for r in self.row_id[i]]
        return [hashlib.blake2b(self.features[j].tobytes() + bytes([int(self.label[j]), int(self.group[j])]),
                                digest_size=16).hexdigest() for j in i]

    def fetch(self, rows: Sequence[int] | np.ndarray) -> torch.Tensor:
        """The model inputs of ``rows`` (see :class:`~hf_constrained.fairness.roc.PairedRows`)."""
        return torch.from_numpy(self.features[np.asarray(rows, dtype=np.int64)])


# --------------------------------------------------------------------------- CheXpert
CHEXPERT_FINDINGS = ("Cardiomegaly", "Edema", "Consolidation", "Atelectasis", "Pleural Effusion")


def load_chexpert(root: str, *, csv_name: str = "train.csv", label: str = "Cardiomegaly",
                  uncertain: str = "ones", group_value: str = "Male") -> datasets.Dataset:
    """Read CheXpert's CSV (``Path``, ``Sex``, one column per finding) under ``root``.

    Returns a Dataset with ``path`` (absolute image path), ``label`` (finding present:
    1; blank: 0; uncertain -1 mapped by ``uncertain`` = ``"ones"`` or ``"zeros"``,
    the U-Ones / U-Zeros policies of the CheXpert paper) and ``group`` (1 where
    ``Sex == group_value``). Rows with an unknown sex are dropped; a missing image file
    is an error naming it. ``Path`` entries are relative to the folder that holds the
    dataset folder (``CheXpert-v1.0-small/train/...``) or to ``root`` itself.
    """
    if uncertain not in ("ones", "zeros"):
        raise ValueError(f"uncertain must be 'ones' or 'zeros', got {uncertain!r}")
    csv_path = os.path.join(root, csv_name)
    if not os.path.exists(csv_path):
        raise FileNotFoundError(f"CheXpert CSV {csv_path!r} not found")
    df = pd.read_csv(csv_path)
    for col in ("Path", "Sex", label):
        if col not in df.columns:
            raise ValueError(f"CheXpert CSV {csv_path!r} has no column {col!r}; columns: {list(df.columns)}")
    df = df[df["Sex"].isin(["Male", "Female"])].reset_index(drop=True)
    raw = df[label].fillna(0).astype(float).to_numpy()
    labels = np.where(raw == -1, 1.0 if uncertain == "ones" else 0.0, raw).astype(np.int64)
    paths = []
    for p in df["Path"]:
        candidates = [os.path.join(root, p), os.path.join(os.path.dirname(os.path.abspath(root)), p)]
        found = next((c for c in candidates if os.path.exists(c)), None)
        if found is None:
            raise FileNotFoundError(f"CheXpert image {p!r} not found under {root!r} (tried {candidates})")
        paths.append(os.path.abspath(found))
    groups = (df["Sex"] == group_value).to_numpy().astype(np.int64)
    import datasets

    return datasets.Dataset.from_dict({"path": paths, "label": labels, "group": groups})


class ImageRows:
    """Rows of an image dataset for :class:`~hf_constrained.fairness.roc.PairedRows`: images
    are read from disk and turned into ``pixel_values`` by a transformers image processor
    only when a batch needs them."""

    def __init__(self, dataset: datasets.Dataset, image_processor: Any) -> None:
        self.paths = list(dataset["path"])
        self.label = np.asarray(dataset["label"], dtype=np.int64)
        self.group = np.asarray(dataset["group"], dtype=np.int64)
        self.image_processor = image_processor

    def __len__(self) -> int:
        return len(self.label)

    def fetch(self, rows: Sequence[int] | np.ndarray) -> torch.Tensor:
        from ..extras import require_extra

        Image = require_extra("PIL.Image", "fairness", "reading CheXpert images")
        images = []
        for r in np.asarray(rows, dtype=np.int64).tolist():
            with Image.open(self.paths[r]) as im:
                images.append(im.convert("RGB"))
        return self.image_processor(images=images, return_tensors="pt")["pixel_values"]
