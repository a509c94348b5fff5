"""Loaders of the CLIP task on small synthetic folders in the BDD100K and CSV layouts."""

import json
import os

import pytest
import torch
from clip_synthetic import WEATHER, make_bdd100k, make_csv, save_tiny_clip

from hf_constrained.clip.data import (
    BDD100K_TASKS,
    CLIPCollator,
    RowDataset,
    bdd100k_task_data,
    csv_target_rows,
    load_bdd100k,
    load_image_text_csv,
)


@pytest.fixture(scope="module")
def bdd(tmp_path_factory):
    return make_bdd100k(str(tmp_path_factory.mktemp("bdd100k")))


def test_bdd100k_labels_by_attribute(bdd):
    out = load_bdd100k(bdd, "train", "weather", ["foggy", "clear"])
    assert set(out) == {"foggy", "clear"} and len(out["foggy"]) == 3 and len(out["clear"]) == 3
    assert all(os.path.exists(r["image"]) and "/images/100k/train/" in r["image"] for r in out["foggy"])
    scene = load_bdd100k(bdd, "val", "scene", ["tunnel", "highway"])
    assert len(scene["tunnel"]) == len(WEATHER) and len(scene["highway"]) == 2 * len(WEATHER)  # undefined skipped


def test_bdd100k_tasks_of_the_paper(bdd):
    assert BDD100K_TASKS["foggy"].protected == ("clear", "overcast", "snowy", "rainy", "partly cloudy")
    assert "foggy" not in BDD100K_TASKS["overcast"].protected and len(BDD100K_TASKS["overcast"].protected) == 4
    assert BDD100K_TASKS["tunnel"].attribute == "scene" and len(BDD100K_TASKS["tunnel"].protected) == 4
    data = bdd100k_task_data(bdd, "foggy", negatives_per_class=2)
    pos = [r for r in data["target_rows"] if r["is_positive"]]
    neg = [r for r in data["target_rows"] if not r["is_positive"]]
    assert len(pos) == 3 and all(r["caption"] == "the weather is foggy." for r in pos)
    assert len(neg) == 2 * 5 and {r["caption"] for r in neg} >= {"the weather is partly cloudy."}
    classes = BDD100K_TASKS["foggy"].classes
    assert all(r["label"] == classes.index("rainy") for r in data["val"]["rainy"])
    assert len(data["train"]["clear"]) == 3 and len(data["val"]["snowy"]) == 3


def test_bdd100k_errors_name_the_problem(bdd, tmp_path):
    with pytest.raises(FileNotFoundError, match="label file"):
        load_bdd100k(str(tmp_path), "train", "weather", ["foggy"])
    broken = make_bdd100k(str(tmp_path / "broken"), per_class=1, extra_undefined=False)
    os.remove(os.path.join(broken, "images", "100k", "train", "train_foggy_0.jpg"))
    with pytest.raises(FileNotFoundError, match="train_foggy_0.jpg"):
        load_bdd100k(broken, "train", "weather", ["foggy"])
    label_file = os.path.join(broken, "labels", "bdd100k_labels_images_val.json")
    with open(label_file, "w") as f:
        json.dump([{"name": "x.jpg"}], f)
    with pytest.raises(ValueError, match="attributes.weather"):
        load_bdd100k(broken, "val", "weather", ["foggy"])


def test_csv_loader_relative_paths_tsv_and_errors(tmp_path):
    path = make_csv(str(tmp_path), [("img/a.jpg", "a foggy road", "foggy"), ("img/b.jpg", "a sunny road", "clear")])
    rows = load_image_text_csv(path)
    assert rows[0]["image"] == os.path.join(str(tmp_path), "img/a.jpg") and rows[1]["label_name"] == "clear"
    marked = csv_target_rows(rows, "foggy", ["clear", "foggy"])
    assert [r["is_positive"] for r in marked] == [True, False] and [r["label"] for r in marked] == [1, 0]
    tsv = make_csv(str(tmp_path / "t"), [("c.jpg", "fog", "foggy")], name="pairs.tsv", delimiter="\t")
    assert load_image_text_csv(tsv)[0]["caption"] == "fog"
    with pytest.raises(ValueError, match="missing columns"):
        load_image_text_csv(path, caption_column="caption")
    with open(path, "a") as f:
        f.write("img/missing.jpg,x,foggy\n")
    with pytest.raises(FileNotFoundError, match=r"pairs.csv: row 3: image not found: .*missing.jpg \(filepath\)"):
        load_image_text_csv(path)


def test_csv_values_are_kept_verbatim_and_malformed_rows_are_named(tmp_path):
    """Every value is the file's text (no NA / number parsing: "007", "NA" and "null" stay);
    a quoted caption may hold commas and line breaks; a row with more or fewer fields than the
    header is an error naming the file, the row and both counts, also the first data row (which
    pandas' CSV reader, under the datasets csv builder, would otherwise cut to the header's
    length), whatever the pandas version (the longer rows are found before pandas reads)."""
    folder = tmp_path / "verbatim"
    path = make_csv(str(folder), [("a.jpg", "a road, foggy\nsecond line", "007"), ("b.jpg", "NA", "null")])
    rows = load_image_text_csv(path)
    assert [(r["caption"], r["label_name"]) for r in rows] == [("a road, foggy\nsecond line", "007"), ("NA", "null")]
    header = "filepath,title,label\n"
    for body, message in (("a.jpg,t,foggy,extra\n", "row 1 has 4 fields, the header has 3"),
                          ("a.jpg,t,foggy\nb.jpg,t,foggy,extra\n", "row 2 has 4 fields, the header has 3"),
                          ('a.jpg,"t, quoted\nover two lines",foggy\n\nb.jpg,t,foggy,x,y\n',
                           "row 2 has 5 fields, the header has 3"),
                          ("a.jpg,t,foggy\n\nb.jpg,t\n", "row 2 has 2 fields, the header has 3")):
        (folder / "bad.csv").write_text(header + body)
        with pytest.raises(ValueError, match=rf"bad.csv: {message}"):
            load_image_text_csv(str(folder / "bad.csv"))
    (folder / "dup.csv").write_text("filepath,title,filepath\na.jpg,t,b.jpg\n")
    with pytest.raises(ValueError, match="repeated column names"):
        load_image_text_csv(str(folder / "dup.csv"), label_column=None)
    (folder / "empty.csv").write_text(header)
    with pytest.raises(ValueError, match="empty.csv: no rows"):
        load_image_text_csv(str(folder / "empty.csv"))


def test_collator_with_a_saved_processor(bdd, tmp_path):
    from transformers import CLIPProcessor

    folder = save_tiny_clip(str(tmp_path / "clip"), ["the weather is foggy."])
    proc = CLIPProcessor.from_pretrained(folder)
    data = bdd100k_task_data(bdd, "foggy", negatives_per_class=1)
    ds = RowDataset(data["target_rows"])
    batch = CLIPCollator(image_processor=proc.image_processor, tokenizer=proc.tokenizer)([ds[i] for i in range(4)])
    assert batch["pixel_values"].shape == (4, 3, 16, 16)
    assert batch["input_ids"].shape[0] == 4 and batch["attention_mask"].shape == batch["input_ids"].shape
    assert batch["sample_index"].tolist() == [0, 1, 2, 3] and batch["is_positive"].dtype == torch.bool
    with pytest.raises(ValueError, match="image_processor"):
        CLIPCollator()([ds[0]])


def test_csv_of_png_images_loads_through_datasets_and_names_what_is_missing(tmp_path):
    """Tiny PNGs (grey, RGBA) listed in a CSV: the rows hold their paths, the collator's images are
    decoded as RGB; a missing CSV, column or image is an error naming it."""
    from PIL import Image

    from hf_constrained.clip.data import _load_image

    Image.new("L", (3, 2), 128).save(tmp_path / "grey.png")
    (tmp_path / "sub").mkdir()
    Image.new("RGBA", (2, 2), (10, 20, 30, 0)).save(tmp_path / "sub" / "rgba.png")
    (tmp_path / "images.csv").write_text("path,kind\ngrey.png,grey\nsub/rgba.png,rgba\n")
    rows = load_image_text_csv(str(tmp_path / "images.csv"), image_column="path", caption_column=None,
                               label_column="kind")
    assert [r["image"] for r in rows] == [str(tmp_path / "grey.png"), str(tmp_path / "sub" / "rgba.png")]
    assert [r["label_name"] for r in rows] == ["grey", "rgba"]
    grey, rgba = (_load_image(r["image"]) for r in rows)
    assert grey.mode == rgba.mode == "RGB" and grey.size == (3, 2) and rgba.getpixel((0, 0)) == (10, 20, 30)
    with pytest.raises(FileNotFoundError, match="CSV not found: .*nothere.csv"):
        load_image_text_csv(str(tmp_path / "nothere.csv"))
    with pytest.raises(ValueError, match=r"images.csv: missing columns \['filepath'\]; found \['path', 'kind'\]"):
        load_image_text_csv(str(tmp_path / "images.csv"), caption_column=None, label_column="kind")
    (tmp_path / "images.csv").write_text("path,kind\ngrey.png,grey\ngone.png,rgba\n")
    with pytest.raises(FileNotFoundError, match=r"images.csv: row 2: image not found: .*gone.png \(path\)"):
        load_image_text_csv(str(tmp_path / "images.csv"), image_column="path", caption_column=None,
                            label_column="kind")


def test_the_tiny_clip_processor_logs_no_backend_fallback(tmp_path):
    """Without torchvision, asking transformers for ``CLIPImageProcessor`` logs a fallback message at
    every demo and recipe start; the library names the PIL processor directly, so a fresh process
    that builds, saves and reloads the tiny processor logs nothing about it."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import sys
        sys.modules["torchvision"] = None  # as without torchvision, also where it is installed: find_spec -> None
        from transformers import CLIPProcessor
        from hf_constrained.clip.tiny import tiny_processor, word_tokenizer
        tiny_processor(word_tokenizer(["a photo of a digit"])).save_pretrained({str(tmp_path)!r})
        print(type(CLIPProcessor.from_pretrained({str(tmp_path)!r}).image_processor).__name__)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "CLIPImageProcessorPil"
    assert "requires torchvision" not in proc.stderr
