"""Tiny synthetic folders in the BDD100K and CSV layouts, and a tiny saved CLIP (shared by CLIP tests)."""

import csv
import json
import os

import numpy as np
from PIL import Image

WEATHER = ["clear", "overcast", "snowy", "rainy", "partly cloudy", "foggy"]


def write_image(path, value, size=(12, 10)):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    rng = np.random.default_rng(abs(hash(path)) % (2**32))
    arr = np.clip(rng.normal(value, 20, size=(size[1], size[0], 3)), 0, 255).astype("uint8")
    Image.fromarray(arr).save(path)


def make_bdd100k(root, per_class=3, extra_undefined=True):
    """images/100k/{train,val}/*.jpg and labels/bdd100k_labels_images_{split}.json."""
    for split in ("train", "val"):
        entries = []
        for c_i, c in enumerate(WEATHER):
            for k in range(per_class):
                name = f"{split}_{c.replace(' ', '_')}_{k}.jpg"
                write_image(os.path.join(root, "images", "100k", split, name), 30 + 35 * c_i)
                entries.append({"name": name, "attributes": {"weather": c, "scene": "tunnel" if k == 0 else "highway",
                                                              "timeofday": "daytime"}, "labels": []})
        if extra_undefined:
            name = f"{split}_undefined.jpg"
            write_image(os.path.join(root, "images", "100k", split, name), 128)
            entries.append({"name": name, "attributes": {"weather": "undefined", "scene": "undefined",
                                                          "timeofday": "night"}, "labels": []})
        os.makedirs(os.path.join(root, "labels"), exist_ok=True)
        with open(os.path.join(root, "labels", f"bdd100k_labels_images_{split}.json"), "w") as f:
            json.dump(entries, f)
    return root


def make_csv(folder, rows, name="pairs.csv", delimiter=","):
    """rows: (relative image path, caption, label); images are written too."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    with open(path, "w", newline="") as f:
        w = csv.writer(f, delimiter=delimiter)
        w.writerow(["filepath", "title", "label"])
        for i, (img, cap, label) in enumerate(rows):
            write_image(os.path.join(folder, img), 40 * (i % 5))
            w.writerow([img, cap, label])
    return path


def save_tiny_clip(folder, texts):
    """A tiny CLIPModel + CLIPProcessor saved with save_pretrained (loads like a hub checkpoint)."""
    from hf_constrained.clip.tiny import tiny_clip, tiny_processor, word_tokenizer

    tok = word_tokenizer(texts)
    model = tiny_clip(len(tok), image_size=16, patch_size=8, hidden_size=32, layers=1, heads=2, projection_dim=16)
    model.save_pretrained(folder)
    tiny_processor(tok, image_size=16).save_pretrained(folder)
    return folder


TINY_CAPTIONS = ["a photo of a cat", "a photo of a dog", "a photo of a car"]


def tiny_contrastive_setup(num_rows: int):
    """A tiny CLIP and ``num_rows`` image-caption rows over three captions; every third row
    (the cats) is a positive. Returns (tokenizer, model, rows as a RowDataset)."""
    import torch

    from hf_constrained.clip.data import RowDataset
    from hf_constrained.clip.tiny import tiny_clip, word_tokenizer

    tok = word_tokenizer(TINY_CAPTIONS)
    model = tiny_clip(len(tok), image_size=8, patch_size=4, hidden_size=32, layers=1, heads=2, projection_dim=16)
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(num_rows):
        c = i % 3
        rows.append({"pixel_values": (torch.randn(3, 8, 8, generator=g) + c).numpy(), "caption": TINY_CAPTIONS[c],
                     "is_positive": c == 0, "label": c})
    return tok, model, RowDataset(rows)
