"""The checkpoint's fingerprint: a changed byte changes it, a touched or copied-in-place file with the
same bytes does not, and an unchanged file is not read again (the per-file hash cache)."""
from __future__ import annotations

import json
import os

import pytest

from pipeline.core.params import parse_params
from pipeline.model.checkpoint_files import HashCache, checkpoint_files, fingerprint


@pytest.fixture
def hf_folder(tmp_path):
    folder = tmp_path / "model"
    (folder / "1_Pooling").mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    (folder / "model.safetensors").write_bytes(b"weights-v1" * 1000)
    (folder / "tokenizer.json").write_text("{}")
    (folder / "1_Pooling" / "config.json").write_text("{}")
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("ref")
    return folder


def params_for(folder):
    return parse_params({"model": {"name": "m", "source": "hf", "checkpoint": str(folder), "task": "text-embedding"}})


def test_every_file_of_the_folder_but_hidden_ones(hf_folder):
    names = [n for n, _ in checkpoint_files(params_for(hf_folder))["checkpoint"]]
    assert names == ["1_Pooling/config.json", "config.json", "model.safetensors", "tokenizer.json"]


def test_a_changed_byte_changes_the_fingerprint_a_touch_does_not(hf_folder, tmp_path):
    cache = HashCache(tmp_path / "hashes.json")
    first = fingerprint(params_for(hf_folder), cache)
    assert cache.hashed_bytes == first["total_bytes"] > 0
    assert str(tmp_path) not in json.dumps(first)                 # no machine path in the record

    again = HashCache(tmp_path / "hashes.json")
    assert fingerprint(params_for(hf_folder), again) == first and again.hashed_bytes == 0   # from the cache

    weights = hf_folder / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10_000_000))                       # touched: same bytes
    touched = HashCache(tmp_path / "hashes.json")
    assert fingerprint(params_for(hf_folder), touched) == first and touched.hashed_bytes == weights.stat().st_size

    weights.write_bytes(b"weights-v2" * 1000)                      # retrained in place: same size, new bytes
    changed = fingerprint(params_for(hf_folder), HashCache(tmp_path / "hashes.json"))
    assert changed != first
    diff = [a["name"] for a, b in zip(first["checkpoint"], changed["checkpoint"]) if a != b]
    assert diff == ["model.safetensors"]


def test_a_state_dict_records_its_factory_source(tmp_path):
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"x" * 64)
    factory = tmp_path / "net.py"
    factory.write_text("def build():\n    pass\n")
    params = parse_params({"model": {"name": "m", "source": "state_dict", "checkpoint": str(weights),
                                     "factory": f"{factory}:build", "task": "tensor", "input_shape": [4]}})
    cache = HashCache(tmp_path / "hashes.json")
    record = fingerprint(params, cache)
    assert [f["name"] for f in record["checkpoint"]] == ["w.safetensors"]
    assert [f["name"] for f in record["factory"]] == ["net.py"]
    factory.write_text("def build():\n    return 1\n")              # the code that builds it changed
    assert fingerprint(params, cache)["factory"] != record["factory"]
