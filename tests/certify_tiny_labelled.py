"""Tiny classifiers and a tiny CLIP, trained here and saved with ``save_pretrained``, for the tests of
``hf-constrained certify`` on classifiers and CLIP zero-shot heads (no download).

- a text classifier (GPT-2 with a classification head, the character tokenizer): a word followed by a digit is of
  class ``one``, ``two`` or ``three`` by its digit. ``base`` learns it; ``kept`` is fine-tuned on new words with the
  right labels (nothing forgotten); ``forgot`` is fine-tuned with the words ending in 1 labelled ``two`` (class
  ``one`` forgotten, the others kept); ``renamed`` is ``base`` with other label names.
- a CLIP (:func:`hf_constrained.clip.tiny.tiny_clip`) whose zero-shot head tells generated circles, crosses and
  bars (:func:`hf_constrained.clip.shapes.draw_shapes`) apart with the prompts "a photo of a {}.": ``base`` trained
  on the zero-shot loss; ``same`` a copy of it; ``forgot`` fine-tuned with the circles labelled cross.
- an image classifier (a ViT with a classification head) on the same images: ``vit_base``, ``vit_same`` (a copy) and
  ``vit_forgot`` (fine-tuned with the circles labelled cross).

Certification images are written as PNG files under a folder of class subfolders and listed in a CSV
(``filepath``, ``label``, the CLIP recipe's columns); the training images under another folder.
"""

from __future__ import annotations

import csv
import json
import os
import random
import shutil

import numpy as np
import torch

LETTERS = "abcdefghijklmnopqrstuvwxyz"
TEXT_CLASSES = ["one", "two", "three"]
SHAPE_CLASSES = ["circle", "cross", "bar"]
TEMPLATE = "a photo of a {}."


def _words(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < n:
        w = "".join(rng.choice(LETTERS) for _ in range(4))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def _text_rows(words: list[str]) -> list[dict]:
    return [{"text": f"{w}{1 + i % 3}", "label": TEXT_CLASSES[i % 3]} for i, w in enumerate(words)]


def _write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def _train_text(model, tokenizer, rows: list[dict], out: str, steps: int, lr: float) -> None:
    """:func:`certify_tiny.fit_and_save` on text/label rows."""
    from certify_tiny import fit_and_save
    from datasets import Dataset

    from hf_constrained.per_sample_loss import PaddingCollator

    index = {c: i for i, c in enumerate(TEXT_CLASSES)}
    data = Dataset.from_list([{**dict(tokenizer(r["text"])), "labels": index[r["label"]]} for r in rows])
    fit_and_save(model, tokenizer, data, PaddingCollator(tokenizer), out, steps, lr)


def build_text(root: str) -> dict[str, str]:
    from transformers import AutoModelForSequenceClassification, GPT2Config, GPT2ForSequenceClassification

    from hf_constrained.recipes.tiny_lm import char_tokenizer

    torch.manual_seed(0)
    tok = char_tokenizer()
    vocab = _words(420, seed=3)
    train, cert, new = vocab[:150], vocab[150:330], vocab[330:]
    paths = {"root": root}
    paths["train"] = _write_jsonl(os.path.join(root, "text_train.jsonl"), _text_rows(train))
    paths["cert"] = _write_jsonl(os.path.join(root, "text_cert.jsonl"), _text_rows(cert))
    paths["new"] = _write_jsonl(os.path.join(root, "text_new.jsonl"), _text_rows(new))
    config = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=32, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2,
                        num_labels=3, id2label=dict(enumerate(TEXT_CLASSES)),
                        label2id={c: i for i, c in enumerate(TEXT_CLASSES)})
    paths["base"] = os.path.join(root, "text_base")
    _train_text(GPT2ForSequenceClassification(config), tok, _text_rows(train), paths["base"], 60, 1e-2)
    paths["kept"] = os.path.join(root, "text_kept")
    _train_text(AutoModelForSequenceClassification.from_pretrained(paths["base"]), tok, _text_rows(new),
                paths["kept"], 20, 2e-3)
    overwrite = [{**r, "label": "two" if r["label"] == "one" else r["label"]} for r in _text_rows(new)]
    paths["forgot"] = os.path.join(root, "text_forgot")
    _train_text(AutoModelForSequenceClassification.from_pretrained(paths["base"]), tok, overwrite, paths["forgot"],
                40, 1e-2)
    paths["renamed"] = os.path.join(root, "text_renamed")
    shutil.copytree(paths["base"], paths["renamed"])
    with open(os.path.join(paths["renamed"], "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["id2label"] = {"0": "uno", "1": "dos", "2": "tres"}
    cfg["label2id"] = {"uno": 0, "dos": 1, "tres": 2}
    with open(os.path.join(paths["renamed"], "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return paths


def _shape_images(stream: int, per_class: int) -> tuple[np.ndarray, np.ndarray]:
    from hf_constrained.clip.shapes import draw_shapes

    images, labels = draw_shapes(7, stream, [per_class] * 3, image_size=16, noise=0.05, classes=SHAPE_CLASSES)
    return (np.clip((images[:, 0] + 1.0) * 127.5, 0, 255)).astype("uint8"), labels


def write_image_folder(folder: str, images: np.ndarray, labels: np.ndarray) -> list[tuple[str, str]]:
    """PNGs under ``folder/CLASS/``; (path relative to ``folder``, class) of each."""
    from PIL import Image

    out = []
    for i, (img, label) in enumerate(zip(images, labels)):
        rel = os.path.join(SHAPE_CLASSES[label], f"{i:04d}.png")
        os.makedirs(os.path.join(folder, SHAPE_CLASSES[label]), exist_ok=True)
        Image.fromarray(img, mode="L").save(os.path.join(folder, rel))
        out.append((rel, SHAPE_CLASSES[label]))
    return out


def _adam_steps(model, batch_loss, n: int, steps: int, lr: float) -> None:
    """``steps`` Adam steps on ``batch_loss(pick)``, 32 rows ``pick`` drawn from ``n`` per step (seed 0)."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        loss = batch_loss(torch.randint(0, n, (32,), generator=gen))
        opt.zero_grad()
        loss.backward()
        opt.step()


def _train_clip(model, processor, images: np.ndarray, labels: np.ndarray, steps: int, lr: float, out: str) -> None:
    """The zero-shot cross-entropy over the class prompts (the library's ``ZeroShotLoss``), Adam, then save."""
    from PIL import Image

    from hf_constrained.clip.non_forgetting import ZeroShotLoss

    prompts = processor.tokenizer([TEMPLATE.format(c) for c in SHAPE_CLASSES], padding=True, return_tensors="pt")
    head = ZeroShotLoss(prompts["input_ids"], prompts["attention_mask"], temperature=0.1)
    pixels = processor.image_processor([Image.fromarray(i, mode="L").convert("RGB") for i in images],
                                       return_tensors="pt")["pixel_values"]
    target = torch.as_tensor(labels).long()
    _adam_steps(model, lambda pick: head.per_sample(model, {"pixel_values": pixels[pick],
                                                            "label": target[pick]}).mean(), len(target), steps, lr)
    model.save_pretrained(out)
    processor.save_pretrained(out)


def build_clip(root: str) -> dict[str, str]:
    from transformers import CLIPModel

    from hf_constrained.clip.tiny import tiny_clip, tiny_processor, word_tokenizer

    tok = word_tokenizer([TEMPLATE.format(c) for c in SHAPE_CLASSES])
    processor = tiny_processor(tok, image_size=16)
    paths = {"root": root}
    images, labels = _shape_images(0, 300)
    paths["base"] = os.path.join(root, "clip_base")
    model = tiny_clip(len(tok), image_size=16, patch_size=4, hidden_size=32, layers=1, heads=2, projection_dim=16)
    _train_clip(model, processor, images, labels, 300, 3e-3, paths["base"])
    paths["same"] = os.path.join(root, "clip_same")
    shutil.copytree(paths["base"], paths["same"])  # a "fine-tune" identical to its base
    new_images, new_labels = _shape_images(1, 60)
    paths["forgot"] = os.path.join(root, "clip_forgot")
    _train_clip(CLIPModel.from_pretrained(paths["base"]), processor, new_images,
                np.where(new_labels == 0, 1, new_labels), 60, 3e-3, paths["forgot"])
    _build_vit(root, paths, images, labels, new_images, new_labels)
    cert_images, cert_labels = _shape_images(2, 60)
    paths["cert_folder"] = os.path.join(root, "shapes_cert")
    listed = write_image_folder(paths["cert_folder"], cert_images, cert_labels)
    paths["cert_csv"] = os.path.join(paths["cert_folder"], "cert.csv")
    with open(paths["cert_csv"], "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["filepath", "label"])
        w.writerows(listed)
    paths["train_folder"] = os.path.join(root, "shapes_train")
    write_image_folder(paths["train_folder"], images, labels)
    return paths


def _build_vit(root: str, paths: dict[str, str], images: np.ndarray, labels: np.ndarray, new_images: np.ndarray,
               new_labels: np.ndarray) -> None:
    from PIL import Image
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    processor = ViTImageProcessor(size={"height": 16, "width": 16})
    config = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=1,
                       num_attention_heads=2, intermediate_size=64, num_labels=3,
                       id2label=dict(enumerate(SHAPE_CLASSES)), label2id={c: i for i, c in enumerate(SHAPE_CLASSES)})

    def train(model, imgs, labs, steps, lr, out):
        pixels = processor([Image.fromarray(i, mode="L").convert("RGB") for i in imgs],
                           return_tensors="pt")["pixel_values"]
        target = torch.as_tensor(labs).long()
        _adam_steps(model, lambda pick: model(pixel_values=pixels[pick], labels=target[pick]).loss, len(target),
                    steps, lr)
        model.save_pretrained(out)
        processor.save_pretrained(out)

    torch.manual_seed(0)
    paths["vit_base"] = os.path.join(root, "vit_base")
    train(ViTForImageClassification(config), images, labels, 300, 3e-3, paths["vit_base"])
    paths["vit_same"] = os.path.join(root, "vit_same")
    shutil.copytree(paths["vit_base"], paths["vit_same"])
    paths["vit_forgot"] = os.path.join(root, "vit_forgot")
    train(ViTForImageClassification.from_pretrained(paths["vit_base"]), new_images,
          np.where(new_labels == 0, 1, new_labels), 60, 3e-3, paths["vit_forgot"])
