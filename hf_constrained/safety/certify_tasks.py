"""What ``hf-constrained certify`` certifies besides causal LMs: classifiers and CLIP zero-shot heads.

Everything here happens before any model loads (no torch): which task the model is, its classes, and the
certification rows of each protected set.

- :func:`detect_task`: ``--task auto`` reads the model's ``config.json`` (``architectures``; for a PEFT adapter its
  ``task_type``, else the base's config): ``*ForCausalLM`` / ``*LMHeadModel`` -> ``causal_lm``,
  ``*ForSequenceClassification`` -> ``sequence_classification``, ``*ForImageClassification`` ->
  ``image_classification``, ``CLIPModel`` -> ``clip``.
- :func:`model_classes`: a classifier's classes (``config.id2label``, in id order); two models whose label sets
  differ (other names, another order, another count) are refused in one line: their accuracies would not be
  about the same question. A CLIP model's classes are ``--class_names`` (default: the labels in the rows).
- :func:`read_labelled_set`: one set's rows. Text classifiers: a JSON/JSONL/CSV/TSV/parquet file (or a Hub
  dataset) with ``text`` and ``label`` columns. Image classifiers and CLIP: the same files with an ``image`` (or
  ``filepath``, the CLIP recipe's CSV column) column of image paths (relative to the file's folder) and
  ``label``; or a folder of class subfolders, ``FOLDER/CLASS/*.png``. A label is a class name or a class index.
  Rows repeated exactly (the same input and label) are dropped with a count; each row is fingerprinted on its
  content (an image by its file's bytes, not its path).
- :func:`split_per_class`: ``--per_class``: every class of a set is its own protected set.
- :func:`inputs_in_training`: certification rows whose input (the text, or the image's bytes) also appears in a
  training file or folder, refused by the plan whatever their label.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from ..certification.splits import row_hash, split_fingerprint
from .certify_claims import TASKS

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
"""The files an image folder's class subfolders may hold."""

ARCHITECTURE_TASKS = (("ForCausalLM", "causal_lm"), ("LMHeadModel", "causal_lm"),
                      ("ForSequenceClassification", "sequence_classification"),
                      ("ForImageClassification", "image_classification"), ("CLIPModel", "clip"))
"""The end of a ``config.json`` architecture name -> the task certified."""

PEFT_TASK_TYPES = {"CAUSAL_LM": "causal_lm", "SEQ_CLS": "sequence_classification"}

IMAGE_TASKS = frozenset({"image_classification", "clip"})


def read_json(path: str) -> dict[str, Any]:
    """A JSON file's object, ``{}`` when there is no such file."""
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return dict(json.load(f))


def _task_of(config: Mapping[str, Any]) -> Optional[str]:
    for arch in config.get("architectures") or ():
        for suffix, task in ARCHITECTURE_TASKS:
            if str(arch).endswith(suffix):
                return task
    return None


def detect_task(model_dir: str, base_model: str, adapter: bool, task: str = "auto") -> str:
    """The task of ``--model`` (``task`` itself unless ``"auto"``); a ``ValueError`` naming ``--task`` when the
    configs do not tell."""
    if task != "auto":
        return task
    found = None
    if adapter:
        found = PEFT_TASK_TYPES.get(str(read_json(os.path.join(model_dir, "adapter_config.json")).get("task_type")))
    found = found or _task_of(read_json(os.path.join(model_dir, "config.json")))
    if found is None and os.path.isdir(base_model):
        found = _task_of(read_json(os.path.join(base_model, "config.json")))
    if found is None:
        if not os.path.isdir(base_model):
            return "causal_lm"  # a Hub base with an adapter or a model without architectures: the default
        archs = read_json(os.path.join(model_dir, "config.json")).get("architectures")
        raise ValueError(f"--model {model_dir}: cannot tell its task from config.json (architectures {archs}); pass "
                         f"--task, one of {', '.join(TASKS)}")
    return found


def _labels(config: Mapping[str, Any]) -> Optional[list[str]]:
    id2label = config.get("id2label")
    if not id2label:
        return None
    return [str(id2label[k]) for k in sorted(id2label, key=lambda k: int(k))]


def model_classes(model_dir: str, base_model: str) -> list[str]:
    """A classifier's classes in id order (the base's; the model's own config must name the same); a one-line
    ``ValueError`` when the two label sets differ."""
    base = _labels(read_json(os.path.join(base_model, "config.json"))) if os.path.isdir(base_model) else None
    own = _labels(read_json(os.path.join(model_dir, "config.json")))
    if base is not None and own is not None and base != own:
        raise ValueError(f"--model {model_dir} and --base_model {base_model} have different label sets ({own} vs "
                         f"{base}): a classifier is certified against a base with the same classes in the same order")
    classes = own or base
    if not classes:
        raise ValueError(f"--model {model_dir}: config.json has no id2label: cannot tell the classifier's classes")
    return classes


@dataclass
class LabelledSet:
    """One protected set of classifier or CLIP rows: each row ``{"text"|"image": ..., "label": class index}``,
    its hash (``hashes``: input and label), the repeats dropped, the format in words, and the hash of each row's
    input alone (``inputs``: the text, the image file's bytes)."""

    rows: list[dict[str, Any]]
    hashes: list[bytes]
    dropped: int
    fmt: str
    inputs: list[bytes]

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def fingerprint(self) -> str:
        return split_fingerprint(self.hashes)


def _image_folder(folder: str) -> list[dict[str, Any]]:
    """``{"image": path, "label": class}`` of every image in ``folder``'s class subfolders (sorted)."""
    rows = []
    for cls in sorted(os.listdir(folder)):
        sub = os.path.join(folder, cls)
        if not os.path.isdir(sub):
            continue
        for name in sorted(os.listdir(sub)):
            if name.lower().endswith(IMAGE_EXTENSIONS):
                rows.append({"image": os.path.abspath(os.path.join(sub, name)), "label": cls})
    return rows


def _file_rows(source: str, split: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of a file or Hub dataset as dicts, and its columns (images undecoded: ``{"path", "bytes"}``)."""
    import datasets

    from .certify_rows import _load

    raw = _load(source, split)
    for col, feature in raw.features.items():
        if isinstance(feature, datasets.Image):
            raw = raw.cast_column(col, datasets.Image(decode=False))
    return [dict(r) for r in raw], list(raw.column_names)


def _image_bytes(value: Any, base_dir: str, where: str, row: int) -> tuple[Any, bytes]:
    """(what the collator loads: a path or an undecoded image, the image file's bytes) of one row's image."""
    if isinstance(value, Mapping):  # a datasets Image, undecoded
        data, path = value.get("bytes"), value.get("path")
        if data:
            import io

            from PIL import Image

            return Image.open(io.BytesIO(data)).convert("RGB"), bytes(data)
        value = path
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: row {row}: no image path")
    path = value if os.path.isabs(value) else os.path.join(base_dir, value)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{where}: row {row}: image not found: {path}")
    with open(path, "rb") as f:
        return path, f.read()


def _class_index(label: Any, classes: Sequence[str], where: str, row: int) -> int:
    if isinstance(label, bool) or label is None:
        raise ValueError(f"{where}: row {row}: label {label!r} is no class")
    if str(label) in classes:
        return list(classes).index(str(label))
    if isinstance(label, int) or (isinstance(label, str) and label.strip().isdigit()):
        index = int(label)
        if 0 <= index < len(classes):
            return index
    shown = list(classes) if len(classes) <= 20 else [*classes[:20], "..."]
    raise ValueError(f"{where}: row {row}: label {label!r} is none of the model's classes {shown} (a class name or "
                     "an index)")


def _raw_rows(source: str, task: str, columns: tuple[str, Optional[str], str], split: str,
              where: str) -> tuple[list[dict[str, Any]], list[str], str, str, str]:
    """(rows, columns, the folder relative image paths start from, the input column, the label column)."""
    text_col, image_col, label_col = columns
    if os.path.isdir(source) and task in IMAGE_TASKS and not os.path.isfile(os.path.join(source, "dataset_info.json")):
        raw = _image_folder(source)
        if not raw:
            raise ValueError(f"{where}: no images in class subfolders (FOLDER/CLASS/*.png)")
        return raw, ["image", "label"], source, "image", "label"
    if os.path.isfile(source) and os.path.getsize(source) == 0:
        raise ValueError(f"{where}: the file is empty")
    try:
        raw, cols = _file_rows(source, split)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{where}: {exc}") from None
    base_dir = os.path.dirname(os.path.abspath(source)) if os.path.exists(source) else os.getcwd()
    if task in IMAGE_TASKS:
        input_col = image_col or ("filepath" if "filepath" in cols and "image" not in cols else "image")
    else:
        input_col = text_col
    return raw, cols, base_dir, input_col, label_col


def _input(value: Any, task: str, base_dir: str, where: str, row: int) -> tuple[Any, bytes]:
    """(the row's input as the collator takes it, the hash of its content)."""
    if task in IMAGE_TASKS:
        loaded, data = _image_bytes(value, base_dir, where, row)
        return loaded, hashlib.sha256(data).digest()
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: row {row}: no text")
    return value, hashlib.sha256(value.encode()).digest()


def read_labelled_set(name: str, source: str, task: str, classes: Optional[Sequence[str]],
                      columns: tuple[str, Optional[str], str], split: str = "train") -> LabelledSet:
    """The rows of set ``name`` for ``task`` (module docstring); ``columns``: (text, image, label) column names
    (image ``None``: ``image``, else ``filepath``). ``classes`` ``None`` (CLIP without ``--class_names``): labels
    are kept as names, mapped later by :func:`index_labels`. One-line errors naming the set for an empty or missing
    file, missing columns, a missing image or a label that is no class."""
    where = f"--protected_datasets {name}={source}"
    raw, cols, base_dir, input_col, label_col = _raw_rows(source, task, columns, split, where)
    if not raw:
        raise ValueError(f"{where}: no rows")
    missing = [c for c in (input_col, label_col) if c not in cols]
    if missing:
        flags = {input_col: "--image_column" if task in IMAGE_TASKS else "--text_column", label_col: "--label_column"}
        raise ValueError(f"{where}: the rows have the columns {cols}; missing {missing} ("
                         + ", ".join(flags[c] for c in missing) + " names another)")
    key = "image" if task in IMAGE_TASKS else "text"
    rows, hashes, inputs, seen = [], [], [], set()
    for i, r in enumerate(raw, start=1):
        label = r[label_col] if classes is None else _class_index(r[label_col], classes, where, i)
        value, content = _input(r[input_col], task, base_dir, where, i)
        h = row_hash({"input": content.hex(), "label": str(r[label_col])})
        if h in seen:
            continue
        seen.add(h)
        rows.append({key: value, "label": label})
        hashes.append(h)
        inputs.append(content)
    fmt = "image/label" if task in IMAGE_TASKS else "text/label"
    return LabelledSet(rows, hashes, len(raw) - len(rows), fmt, inputs)


def clip_classes(sets: Mapping[str, LabelledSet], class_names: Sequence[str]) -> list[str]:
    """A CLIP head's classes: ``class_names``, or the labels of every set (sorted); a label given as an index
    needs ``--class_names``."""
    if class_names:
        return list(class_names)
    labels = {r["label"] for s in sets.values() for r in s.rows}
    if any(not isinstance(label, str) or label.strip().isdigit() for label in labels):
        raise ValueError("--class_names: the rows give labels as class indices; name the zero-shot head's classes "
                         "in order with --class_names")
    return sorted(labels)


def index_labels(name: str, data: LabelledSet, classes: Sequence[str]) -> None:
    """Labels given as names (CLIP without ``--class_names``) turned into class indices, in place."""
    for i, row in enumerate(data.rows, start=1):
        if not isinstance(row["label"], int):
            row["label"] = _class_index(row["label"], classes, f"--protected_datasets {name}", i)


def split_per_class(sets: Mapping[str, LabelledSet], classes: Sequence[str]) -> dict[str, LabelledSet]:
    """``--per_class``: each class of each set as its own set, named by the class (``SET/CLASS`` when there are
    several sets), in class order; classes a set has no row of are left out."""
    out = {}
    for set_name, data in sets.items():
        for c, cls in enumerate(classes):
            keep = [i for i, r in enumerate(data.rows) if r["label"] == c]
            if keep:
                name = cls if len(sets) == 1 else f"{set_name}/{cls}"
                out[name] = LabelledSet([data.rows[i] for i in keep], [data.hashes[i] for i in keep], 0, data.fmt,
                                        [data.inputs[i] for i in keep])
    return out


def inputs_in_training(data: LabelledSet, train_files: Sequence[str], task: str,
                       columns: tuple[str, Optional[str], str], split: str = "train") -> dict[str, int]:
    """Per training file (or image folder), how many of ``data``'s rows have an input (the text, the image file's
    bytes) that it holds too, whatever the label; files without the input column are skipped."""
    out = {}
    for path in train_files:
        where = f"--train_files {path}"
        raw, cols, base_dir, input_col, _ = _raw_rows(path, task, columns, split, where)
        if input_col not in cols:
            continue
        seen = {_input(r[input_col], task, base_dir, where, i)[1] for i, r in enumerate(raw, start=1)}
        count = sum(h in seen for h in data.inputs)
        if count:
            out[path] = count
    return out


__all__ = ["IMAGE_EXTENSIONS", "IMAGE_TASKS", "LabelledSet", "clip_classes", "detect_task", "index_labels",
           "inputs_in_training", "model_classes", "read_json", "read_labelled_set", "split_per_class"]
