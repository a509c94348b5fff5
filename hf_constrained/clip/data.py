"""Rows, the collator and the loaders of the CLIP non-forgetting task.

A row is a dict. Target (objective) rows: ``image`` (a path, a PIL image or an array) or
ready ``pixel_values``, ``caption``, ``is_positive`` (the target class's pairs are the
anchors) and optionally ``label`` (class index) and ``text_class_id`` (for per-class text
heads). Protected-class rows: an image and ``label``. :class:`RowDataset` adds
``sample_index`` (the row's position), which indexes the per-sample MSVR estimators.

Loaders:

* :func:`load_bdd100k` - BDD100K's official label JSON (``attributes.weather`` /
  ``attributes.scene``) and image folders ``images/100k/{train,val}``;
  :data:`BDD100K_TASKS` holds the paper's three tasks (foggy, overcast, tunnel).
* :func:`load_image_text_csv` - a generic CSV of (image path, caption, label), the format
  of the reference code's LAION retrievals.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from ..extras import require_extra


class RowDataset(torch.utils.data.Dataset):
    """A list of dict rows; ``dataset[i]`` also carries ``sample_index = i``."""

    def __init__(self, rows: Sequence[Mapping[str, Any]]) -> None:
        self.rows = list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = dict(self.rows[i])
        row["sample_index"] = int(i)
        return row

    def column(self, name: str) -> list:
        return [r[name] for r in self.rows]


def _load_image(image: Any) -> Any:
    """An RGB image from a path (decoded by ``datasets.Image``), or ``image`` as it is."""
    if isinstance(image, (str, os.PathLike)):
        import datasets

        if not os.path.exists(image):
            raise FileNotFoundError(f"image file not found: {image}")
        require_extra("PIL", "clip", "decoding the CLIP images")
        return datasets.Image(mode="RGB").decode_example({"path": os.fspath(image), "bytes": None})
    return image


@dataclass
class CLIPCollator:
    """Collate rows into CLIP batches.

    Args:
        image_processor: turns a list of images into ``pixel_values`` (e.g. a
            ``CLIPImageProcessor`` or ``CLIPProcessor.image_processor``); unused for rows that
            already hold ``pixel_values``.
        tokenizer: tokenises ``caption`` (padding to the longest).
        max_length: truncation length of captions (default: the tokenizer's).
        image_transform: optional callable applied to each loaded image before the
            processor (training augmentation of the objective only; constraint and
            reference passes use a collator without it).

    Output keys: ``pixel_values``, and where the rows have them ``input_ids`` /
    ``attention_mask`` (captions), ``is_positive``, ``label``, ``sample_index``,
    ``reference_loss``, ``reference_correct`` (certification rows), ``text_class_ids``.
    """

    image_processor: Optional[Callable] = None
    tokenizer: Optional[Callable] = None
    max_length: Optional[int] = None
    image_transform: Optional[Callable] = None
    extra_keys: tuple = field(default=())

    def pixel_values(self, rows: Sequence[Mapping[str, Any]]) -> torch.Tensor:
        if all("pixel_values" in r for r in rows):
            return torch.stack([torch.as_tensor(np.asarray(r["pixel_values"]), dtype=torch.float32) for r in rows])
        if self.image_processor is None:
            raise ValueError("rows hold images but the collator has no image_processor")
        images = [_load_image(r["image"]) for r in rows]
        if self.image_transform is not None:
            images = [self.image_transform(im) for im in images]
        return self.image_processor(images=images, return_tensors="pt")["pixel_values"]

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        batch: dict[str, Any] = {"pixel_values": self.pixel_values(rows)}
        if "caption" in rows[0]:
            if self.tokenizer is None:
                raise ValueError("rows have captions but the collator has no tokenizer")
            kwargs = {"padding": True, "truncation": True, "return_tensors": "pt"}
            if self.max_length is not None:
                kwargs["max_length"] = self.max_length
            tokens = self.tokenizer([r["caption"] for r in rows], **kwargs)
            batch["input_ids"] = tokens["input_ids"]
            if "attention_mask" in tokens:
                batch["attention_mask"] = tokens["attention_mask"]
        for key, out, dtype in (("is_positive", "is_positive", torch.bool), ("label", "label", torch.long),
                                ("sample_index", "sample_index", torch.long),
                                ("reference_loss", "reference_loss", torch.float32),
                                ("reference_correct", "reference_correct", torch.float32),
                                ("text_class_id", "text_class_ids", torch.long)):
            if key in rows[0]:
                batch[out] = torch.as_tensor([r[key] for r in rows], dtype=dtype)
        for key in self.extra_keys:
            batch[key] = [r.get(key) for r in rows]
        return batch


# ---------------------------------------------------------------------------------- BDD100K


@dataclass(frozen=True)
class BDD100KTask:
    """One of the paper's BDD100K tasks: the attribute, the target class, the protected ones."""

    attribute: str
    target: str
    protected: tuple[str, ...]
    template: str

    @property
    def classes(self) -> tuple[str, ...]:
        """Every class of the zero-shot classifier (protected first, then the target)."""
        return self.protected + (self.target,)


BDD100K_TASKS: dict[str, BDD100KTask] = {
    "foggy": BDD100KTask("weather", "foggy", ("clear", "overcast", "snowy", "rainy", "partly cloudy"),
                         "the weather is {}."),
    "overcast": BDD100KTask("weather", "overcast", ("clear", "snowy", "rainy", "partly cloudy"),
                            "the weather is {}."),
    "tunnel": BDD100KTask("scene", "tunnel", ("highway", "residential area", "city street", "parking lot"),
                          "the scene is a {}."),
}


def bdd100k_label_file(root: str, split: str) -> str:
    """The official label JSON of a split: ``labels/bdd100k_labels_images_{split}.json``."""
    return os.path.join(root, "labels", f"bdd100k_labels_images_{split}.json")


def load_bdd100k(root: str, split: str, attribute: str, classes: Sequence[str], *,
                 label_file: Optional[str] = None, image_dir: Optional[str] = None,
                 check_images: bool = True) -> dict[str, list[dict[str, Any]]]:
    """Images of each class in ``classes`` by ``attributes[attribute]`` of the official labels.

    Args:
        root: the BDD100K folder (``images/100k/{split}`` and ``labels/``).
        split: ``train`` or ``val``.
        attribute: ``weather``, ``scene`` or ``timeofday``.
        classes: the values to keep; others (e.g. ``undefined``) are skipped.
        label_file / image_dir: override the default layout.

    Returns ``{class: [{"image": path, "class_name": class}, ...]}`` in label-file order.
    """
    label_file = label_file or bdd100k_label_file(root, split)
    image_dir = image_dir or os.path.join(root, "images", "100k", split)
    if not os.path.exists(label_file):
        raise FileNotFoundError(f"BDD100K label file not found: {label_file}")
    with open(label_file) as f:
        entries = json.load(f)
    if not isinstance(entries, list):
        raise ValueError(f"{label_file}: expected a JSON list of image entries, got {type(entries).__name__}")
    out: dict[str, list[dict[str, Any]]] = {c: [] for c in classes}
    for entry in entries:
        try:
            value = entry["attributes"][attribute]
            name = entry["name"]
        except (KeyError, TypeError):
            raise ValueError(f"{label_file}: entry without name/attributes.{attribute}: {str(entry)[:200]}") from None
        if value in out:
            path = os.path.join(image_dir, name)
            if check_images and not os.path.exists(path):
                raise FileNotFoundError(f"BDD100K image listed in {label_file} is missing: {path}")
            out[value].append({"image": path, "class_name": value})
    return out


def bdd100k_task_data(root: str, task: str | BDD100KTask, *, max_per_class: Optional[int] = None,
                      negatives_per_class: Optional[int] = None, seed: int = 0,
                      label_files: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """The data of one paper task: target pairs, protected-class train/val images.

    The target (objective) rows are the target-class train images captioned with the
    template (positives) and train images of the other classes captioned with theirs
    (negatives, at most ``negatives_per_class`` each). Protected rows carry ``label`` = the
    class index in ``task.classes``.
    """
    spec = BDD100K_TASKS[task] if isinstance(task, str) else task
    label_files = label_files or {}
    rng = np.random.default_rng(seed)
    splits = {}
    for split in ("train", "val"):
        splits[split] = load_bdd100k(root, split, spec.attribute, spec.classes, label_file=label_files.get(split))
    class_index = {c: i for i, c in enumerate(spec.classes)}

    def take(rows: list, limit: Optional[int]) -> list:
        if limit is None or len(rows) <= limit:
            return rows
        keep = sorted(rng.choice(len(rows), size=limit, replace=False).tolist())
        return [rows[i] for i in keep]

    target_rows = []
    for c in spec.classes:
        limit = max_per_class if c == spec.target else negatives_per_class
        for r in take(splits["train"][c], limit):
            target_rows.append({"image": r["image"], "caption": spec.template.format(c),
                                "is_positive": c == spec.target, "label": class_index[c]})
    protected = {split: {c: [{"image": r["image"], "label": class_index[c]}
                             for r in take(splits[split][c], max_per_class)]
                         for c in spec.classes} for split in ("train", "val")}
    for split in protected:
        for c, rows in protected[split].items():
            if not rows and c in spec.protected:
                raise ValueError(f"BDD100K {split}: no images of class {c!r} ({spec.attribute})")
    if not any(r["is_positive"] for r in target_rows):
        raise ValueError(f"BDD100K train: no images of the target class {spec.target!r}")
    return {"task": spec, "target_rows": target_rows, "train": protected["train"], "val": protected["val"]}


# ---------------------------------------------------------------------------------- CSV


def _csv_header(path: str, delimiter: str) -> tuple[list[str], bool]:
    """The header row as written (pandas would rename a repeated name ``x`` to ``x.1``), and
    whether a data row follows it."""
    import warnings

    import pandas as pd  # a dependency of datasets

    try:
        with warnings.catch_warnings():  # a longer first data row is reported by _read_csv_rows
            warnings.simplefilter("ignore", pd.errors.ParserWarning)
            first = pd.read_csv(path, sep=delimiter, header=None, nrows=2, dtype=str, keep_default_na=False,
                                engine="python", on_bad_lines=lambda fields: fields)
    except pd.errors.EmptyDataError:
        raise ValueError(f"{path}: empty file (no header row)") from None
    return [str(v) for v in first.iloc[0].tolist()], len(first) > 1


def _check_row_lengths(path: str, header: Sequence[str], delimiter: str) -> None:
    """A data row with more fields than the header, the extra ones holding text, is an error naming its row (1 = the
    first data row; blank lines are skipped, as pandas skips them), found with Python's own CSV reader before pandas
    reads the file: how pandas reports a longer row (a warning for the first data row, a callback or a shift for the
    others) differs between its versions, and it names no row. Trailing delimiters (empty extra fields) are left to
    pandas, which reads a file whose every row ends in one (``index_col=False``)."""
    import csv

    if len(delimiter) != 1:  # a regular-expression separator: pandas' own checks only
        return
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            records = csv.reader(f, delimiter=delimiter)
            next(records, None)  # the header
            row = 0
            for fields in records:
                if not fields:
                    continue
                row += 1
                if len(fields) > len(header) and any(fields[len(header):]):
                    raise ValueError(f"{path}: row {row} has {len(fields)} fields, the header has {len(header)}: "
                                     f"{fields}")
    except (UnicodeDecodeError, csv.Error) as err:
        raise ValueError(f"{path}: not a readable CSV: {err}") from err


def _read_csv_rows(path: str, header: Sequence[str], delimiter: str) -> Any:
    """Every field of ``path`` as text, with ``datasets``' csv builder (``Dataset.from_csv``):
    no number or NA parsing ("007", "NA" stay), quoted fields may hold delimiters and line
    breaks; a row with more fields than the header is an error naming the row
    (:func:`_check_row_lengths`; pandas would drop the extra fields of the first data row with a
    warning, and shift others), a shorter row leaves ``None`` in its missing fields. Read into
    memory through a temporary cache, so a later call parses (and checks) the file again."""
    import tempfile
    import warnings

    import datasets
    from pandas.errors import ParserWarning

    _check_row_lengths(path, header, delimiter)

    def too_many(fields: list[str]) -> None:
        raise ValueError(f"{path}: a row has {len(fields)} fields, the header has {len(header)}: {fields}")

    features = datasets.Features({c: datasets.Value("string") for c in header})
    bars = not datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()  # no "Generating train split" bar for a file the user named
    with tempfile.TemporaryDirectory() as cache, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ParserWarning)
        try:
            ds = datasets.Dataset.from_csv(path, sep=delimiter, features=features, keep_default_na=False,
                                           index_col=False, engine="python", on_bad_lines=too_many,
                                           cache_dir=cache, keep_in_memory=True)
        except datasets.exceptions.DatasetGenerationError as err:
            cause = err.__cause__
            if isinstance(cause, ValueError):
                raise cause from err
            raise ValueError(f"{path}: not a readable CSV: {cause}") from err
        finally:
            if bars:
                datasets.utils.enable_progress_bars()
    extra = [w for w in caught if issubclass(w.category, ParserWarning)]
    if extra:  # the first data row had more fields than the header
        raise ValueError(f"{path}: the first data row has more fields than the header ({len(header)}: {header})")
    return ds


def load_image_text_csv(path: str, *, image_column: str = "filepath", caption_column: Optional[str] = "title",
                        label_column: Optional[str] = "label", root: Optional[str] = None,
                        delimiter: Optional[str] = None, check_images: bool = True) -> list[dict[str, Any]]:
    """Rows ``{"image", "caption", "label_name"}`` of a CSV/TSV of image-text pairs.

    ``caption_column=None`` reads image-label lists (rows without ``caption``).

    The file is read with ``datasets`` (``Dataset.from_csv``, every field kept as text) and
    the image column cast to ``datasets.Image``; ``image`` is the image file's path, decoded
    by :class:`CLIPCollator` when a batch is built. Relative image paths are resolved against
    ``root`` (default: the CSV's folder). The delimiter is sniffed from the extension
    (``.tsv`` -> tab) unless given. A missing file, column or image, a repeated column name
    and a row with more or fewer fields than the header are errors naming the file (and the
    row, counted from 1 after the header).
    """
    import datasets

    if not os.path.exists(path):
        raise FileNotFoundError(f"CSV not found: {path}")
    root = root if root is not None else os.path.dirname(os.path.abspath(path))
    delimiter = delimiter or ("\t" if path.endswith(".tsv") else ",")
    header, has_rows = _csv_header(path, delimiter)
    needed = [image_column] + [c for c in (caption_column, label_column) if c]
    missing = [c for c in needed if c not in header]
    if missing:
        raise ValueError(f"{path}: missing columns {missing}; found {header}")
    if len(set(header)) != len(header):
        raise ValueError(f"{path}: repeated column names in the header {header}")
    if not has_rows:
        raise ValueError(f"{path}: no rows")
    ds = _read_csv_rows(path, header, delimiter)
    for i, rec in enumerate(ds):
        given = [v for v in rec.values() if v is not None]
        if len(given) != len(header):
            raise ValueError(f"{path}: row {i + 1} has {len(given)} fields, the header has {len(header)}")
        if not rec[image_column]:
            raise ValueError(f"{path}: row {i + 1}: empty {image_column}")

    # the image column as the datasets Image feature: its files' paths, decoded when a batch is collated
    images = ds.cast_column(image_column, datasets.Image(decode=False))[image_column]
    rows = []
    for i, (image, rec) in enumerate(zip(images, ds)):
        file = image["path"] if os.path.isabs(image["path"]) else os.path.join(root, image["path"])
        if check_images and not os.path.exists(file):
            raise FileNotFoundError(f"{path}: row {i + 1}: image not found: {file} ({image_column})")
        row = {"image": file}
        if caption_column:
            row["caption"] = rec[caption_column]
        if label_column:
            row["label_name"] = rec[label_column]
        rows.append(row)
    return rows


def csv_target_rows(rows: Sequence[Mapping[str, Any]], target: str, classes: Sequence[str]) -> list[dict[str, Any]]:
    """Mark CSV rows as positives (``label_name == target``) or negatives, with class indices."""
    index = {c: i for i, c in enumerate(classes)}
    out = []
    for r in rows:
        name = r.get("label_name", target)
        out.append({"image": r["image"], "caption": r["caption"], "is_positive": name == target,
                    "label": index.get(name, -1)})
    return out
