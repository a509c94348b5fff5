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


def test_binary_files_through_atomic_open_whole_or_not_at_all(tmp_path, monkeypatch):
    """``torch.save``/``numpy.savez`` go through ``atomic_open``: written whole (synced with ``fsync``); a write that
    fails midway leaves the old file and no temporary one; the temporary name ends with ``.tmp``, which a
    checkpoint's manifest and the Hub push leave out."""
    import numpy as np
    import torch

    from hf_constrained.constraint_state import atomic_torch_save

    path = str(tmp_path / "state.pt")
    atomic_torch_save({"x": torch.arange(3)}, path)
    assert torch.equal(torch.load(path)["x"], torch.arange(3))
    seen = []
    with pytest.raises(RuntimeError, match="midway"):
        with atomic.atomic_open(path, "wb") as f:
            seen.append(f.name)
            f.write(b"half")
            raise RuntimeError("midway")
    assert seen[0].endswith(".tmp") and os.path.dirname(seen[0]) == str(tmp_path)
    assert torch.equal(torch.load(path)["x"], torch.arange(3)) and os.listdir(tmp_path) == ["state.pt"]
    npz = str(tmp_path / "splits.npz")
    with atomic.atomic_open(npz, "wb", fsync=True) as f:
        np.savez_compressed(f, a=np.ones(2))
    assert np.load(npz)["a"].tolist() == [1.0, 1.0] and sorted(os.listdir(tmp_path)) == ["splits.npz", "state.pt"]
    with pytest.raises(ValueError, match="mode"):
        with atomic.atomic_open(npz, "a"):
            pass
