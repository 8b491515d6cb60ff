"""The ONNX export cache keeps an export only for the builds of the run that read it again
(pipeline/build/variants/export_cache.py, stages/convert.py): kept with one mark per reader to come,
removed when the last one ends, never kept when no other ONNX variant is in the run. The builds
themselves are stand-ins writing and reading the cache as the ONNX converter does (the real
converter's reuse is tests/build/test_variants.py)."""
from __future__ import annotations

import pytest

from pipeline.build.variants import export_cache as ec

ALL_ONNX = ["eager", "onnx", "onnx-fp16", "onnx-int8-dynamic", "onnx-int8-static"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(ec.READERS_ENV, raising=False)
    return ec.cache_root()


def export_files(tmp_path):
    raw = tmp_path / "raw.onnx"
    raw.write_bytes(b"graph" * 1000)
    data = tmp_path / "raw.onnx.data"
    data.write_bytes(b"w" * 4096)
    return [raw, data]


def build(variant: str, variants: list[str], tmp_path, key: str = "k1") -> dict:
    """One convert stage of `variant` in a run of `variants`: the stage's wrapper around a build
    that restores the export or exports and keeps it."""
    from stages.convert import convert_sharing_the_export

    class P:
        pass
    params = P()
    params.variants = variants
    out = tmp_path / variant
    out.mkdir(parents=True, exist_ok=True)

    def convert():
        return ec.cached_export(key, out / "raw.onnx", lambda: export_files(out),
                                lambda: [out / "raw.onnx", out / "raw.onnx.data"])
    return convert_sharing_the_export(variant, params, convert)


def test_a_full_run_keeps_the_export_until_its_last_reader_and_no_longer(cache, tmp_path):
    first = build("onnx", ALL_ONNX, tmp_path)
    assert first["reused"] is False
    marks = sorted(p.name.split("@")[0] for p in (cache / "k1" / ec.READERS).iterdir())
    assert marks == ["onnx-fp16", "onnx-int8-dynamic", "onnx-int8-static"]
    assert build("onnx-fp16", ALL_ONNX, tmp_path)["reused"] is True
    assert build("onnx-int8-dynamic", ALL_ONNX, tmp_path)["reused"] is True
    assert (cache / "k1").is_dir()
    assert build("onnx-int8-static", ALL_ONNX, tmp_path)["reused"] is True
    assert not (cache / "k1").exists()          # nobody reads it again: no copy of the model left behind


def test_a_run_with_one_onnx_variant_keeps_nothing(cache, tmp_path):
    assert build("onnx", ["eager", "onnx", "torchscript"], tmp_path)["reused"] is False
    assert not cache.exists() or not any(cache.iterdir())


def test_a_reader_that_never_exports_still_takes_its_mark_off(cache, tmp_path, monkeypatch):
    """A variant skipped before its build (onnx-fp16 on a CPU without fp16) reads nothing, but its
    stage ends: its mark goes, and the export with it once nobody else is to come."""
    from stages.convert import convert_sharing_the_export
    run = ["eager", "onnx", "onnx-fp16"]
    build("onnx", run, tmp_path)
    assert (cache / "k1").is_dir()

    class P:
        variants = run
    assert convert_sharing_the_export("onnx-fp16", P(), lambda: {"status": "skipped"}) == {"status": "skipped"}
    assert not (cache / "k1").exists()


def test_marks_are_per_workspace_and_unmarked_entries_are_left_alone(cache, tmp_path, monkeypatch):
    ec.store("other-ws", export_files(tmp_path), readers=["onnx-fp16@another-workspace"])
    ec.store("untracked", export_files(tmp_path), readers=None)       # a build outside the convert stage
    assert ec.finished(ec.reader_id("onnx-fp16")) == []
    assert (cache / "other-ws").is_dir() and (cache / "untracked").is_dir()
    # restore copies the export's files, never the marks
    dest = tmp_path / "dest"
    dest.mkdir()
    assert ec.restore("other-ws", dest) == ["raw.onnx", "raw.onnx.data"]
    assert ec.finished("onnx-fp16@another-workspace") == [cache / "other-ws"]
    assert (cache / "untracked").is_dir()


def test_the_export_goes_in_and_out_as_links_and_a_rewrite_never_reaches_it(cache, tmp_path):
    """Issue 30: a 2 GB export was copied into the cache and out of it three times. Both ways are
    hard links on one filesystem now; the ONNX steps' rewrites are new files (onnx._save), so a
    build rewriting its restored export (fp16) leaves the cached bytes as they were."""
    from pipeline.build.variants.onnx import _save
    src = tmp_path / "first"
    src.mkdir()
    files = export_files(src)
    ec.store("k", files, readers=None)
    entry = cache / "k"
    assert (entry / "raw.onnx").stat().st_ino == files[0].stat().st_ino      # linked, not copied
    dest = tmp_path / "later"
    dest.mkdir()
    assert ec.restore("k", dest) == ["raw.onnx", "raw.onnx.data"]
    assert (dest / "raw.onnx").stat().st_ino == (entry / "raw.onnx").stat().st_ino
    import onnx
    from onnx import TensorProto, helper
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    _save(helper.make_model(graph), dest / "raw.onnx", external=False)       # the fp16 step's rewrite
    assert isinstance(onnx.load(str(dest / "raw.onnx")), onnx.ModelProto)
    assert (entry / "raw.onnx").read_bytes() == b"graph" * 1000            # the cached export untouched
    assert (entry / "raw.onnx.data").read_bytes() == b"w" * 4096 and not (dest / "raw.onnx.data").exists()


def test_external_data_is_copied_so_the_onnx_checker_accepts_a_restored_export(cache, tmp_path):
    """onnx's checker refuses an external-data file with more than one hard link ("a potential hardlink
    attack"): every ONNX build of a 2 GB model restored from a linked cache failed with it."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    src = tmp_path / "first"
    src.mkdir()
    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [w])
    onnx.save(helper.make_model(graph), str(src / "raw.onnx"), save_as_external_data=True,
              location="raw.onnx.data", size_threshold=0)
    files = [src / "raw.onnx", src / "raw.onnx.data"]
    ec.store("ext", files, readers=None)
    assert (src / "raw.onnx.data").stat().st_nlink == 1          # the build's own copy stays single
    dest = tmp_path / "later"
    dest.mkdir()
    assert ec.restore("ext", dest) == ["raw.onnx", "raw.onnx.data"]
    assert (dest / "raw.onnx").stat().st_ino == (cache / "ext" / "raw.onnx").stat().st_ino   # the graph linked
    assert (dest / "raw.onnx.data").stat().st_nlink == 1                                     # the data copied
    onnx.checker.check_model(str(dest / "raw.onnx"))


def test_only_the_onnx_builds_after_this_one_are_its_readers():
    """An entry stored by onnx-int8-dynamic (a fused export under its own key) was marked for onnx and
    onnx-fp16, which had already run: 2.2 GB stayed in the cache after a 2 GB model's run."""
    onnx = ("onnx", "onnx-fp16", "onnx-int8-dynamic", "onnx-int8-static")
    variants = ["eager", "onnx", "onnx-fp16", "aoti", "onnx-int8-dynamic", "onnx-int8-static", "int8"]
    assert ec.later_readers(variants, "onnx", onnx) == ["onnx-fp16", "onnx-int8-dynamic", "onnx-int8-static"]
    assert ec.later_readers(variants, "onnx-int8-dynamic", onnx) == ["onnx-int8-static"]
    assert ec.later_readers(variants, "onnx-int8-static", onnx) == []
    assert ec.later_readers(["eager"], "onnx", onnx) == []
