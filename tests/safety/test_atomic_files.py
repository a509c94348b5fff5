"""The one atomic write of the package (reports, ledgers, cards, results files): the old file or the new one, never
half of one, and no temporary file left behind."""

import json
import os

import pytest

import hf_constrained.atomic_files as atomic
from hf_constrained.atomic_files import atomic_write_json, atomic_write_text


def test_written_whole_into_a_new_folder_with_nothing_left_beside_it(tmp_path):
    path = str(tmp_path / "new" / "folder" / "results.json")
    assert atomic_write_json(path, {"b": 1, "a": [1.5, None]}, indent=1, sort_keys=True, newline=True) == path
    text = open(path, encoding="utf-8").read()
    assert text == json.dumps({"a": [1.5, None], "b": 1}, indent=1) + "\n"
    atomic_write_text(path, "second")
    assert open(path, encoding="utf-8").read() == "second"
    assert os.listdir(tmp_path / "new" / "folder") == ["results.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary_file(tmp_path, monkeypatch):
    path = str(tmp_path / "report.json")
    atomic_write_json(path, {"certified": True})
    with pytest.raises(TypeError):  # not serialisable: nothing is written at all
        atomic_write_json(path, {"certified": object()})
    with pytest.raises(ValueError):  # strict JSON refuses a NaN before any file is opened
        atomic_write_json(path, {"bound": float("nan")}, allow_nan=False)

    def interrupted(src, dst):
        raise KeyboardInterrupt  # e.g. Ctrl-C between writing the temporary file and moving it into place

    monkeypatch.setattr(atomic.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_json(path, {"certified": False})
    assert json.loads(open(path, encoding="utf-8").read()) == {"certified": True}
    assert os.listdir(tmp_path) == ["report.json"]
