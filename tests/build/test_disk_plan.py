"""The disk plan (pipeline/build/disk_plan.py) on real filesystems: a size-limited tmpfs refuses a run
that cannot fit, naming the bytes and the variants to drop; the convert stage stops before
converting; a full disk is recognised from the real error; links into DVC's cache are counted once."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.build.disk_plan import human, plan_run, weight_bytes
from pipeline.core.disk import footprint

REPO_ROOT = Path(__file__).resolve().parents[2]
ALL = ["eager", "torchscript", "fp16", "bf16", "onnx", "onnx-fp16", "aoti", "onnx-int8-dynamic",
       "onnx-int8-static", "int8"]


@pytest.fixture
def small_fs(tmp_path):
    """A 24 MB tmpfs: a real filesystem that really fills up."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a size-limited tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def write_checkpoint(path: Path, mb: int) -> Path:
    from safetensors.numpy import save_file
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"w": np.zeros((mb << 20) // 4, dtype=np.float32)}, str(path))
    return path


def test_plan_refuses_what_does_not_fit_and_names_what_to_drop(small_fs):
    ws = small_fs / "repo"
    ws.mkdir()
    weights = 2 << 20
    plan = plan_run(weights, ALL, ws, ws / ".dvc" / "cache", small_fs / "tmp", small_fs / "export",
                    ["hardlink", "copy"])
    assert not plan.ok
    (mount, need), = plan.required.items()
    free = shutil.disk_usage(small_fs).free
    assert str(mount) == str(small_fs) and plan.free[mount] == free and need > free
    msg = plan.message()
    assert f"needs ~{human(need)} on {small_fs}" in msg and f"{human(free)} free" in msg
    drop = plan.drop_suggestion()
    assert drop and "eager" not in drop and f"drop variants {', '.join(drop)}" in msg
    # Dropping what it says makes the same run fit.
    kept = [v for v in ALL if v not in drop]
    assert plan_run(weights, kept, ws, ws / ".dvc" / "cache", small_fs / "tmp", small_fs / "export",
                    ["hardlink", "copy"]).ok
    # When even eager alone cannot fit, dropping variants is not offered as the fix.
    huge = plan_run(weights * 8, ALL, ws, ws / ".dvc" / "cache", small_fs / "tmp", small_fs / "export",
                    ["hardlink", "copy"])
    assert not huge.ok and huge.drop_suggestion() == [] and "free space" in huge.message()


def test_copies_into_the_cache_double_the_workspace_needs(tmp_path):
    ws = tmp_path / "repo"
    ws.mkdir()
    args = (10 << 20, ["eager", "onnx"], ws, ws / ".dvc" / "cache", tmp_path / "tmp", tmp_path / "export")
    linked, copied = plan_run(*args, ["hardlink", "copy"]), plan_run(*args, ["copy"])
    extra = [n for n in copied.needs if n.what.startswith("DVC cache copy")]
    assert not [n for n in linked.needs if n.what.startswith("DVC cache copy")]
    # What stages hold only while they run (serve_check's reference archives) is no DVC output.
    assert len(extra) == 1 and extra[0].bytes == sum(n.bytes for n in linked.needs if n.where == ws and not n.scratch)
    refs, = [n for n in linked.needs if n.what.startswith("serve_check")]
    assert refs.scratch and refs.where == ws


def test_the_references_archives_are_held_only_while_serve_check_runs(tmp_path):
    """Issue 30: the naive baseline's and the hand-tuned .mar are packed in serve_check's scratch and
    removed after, the winner's folder form links its variant: the run keeps ~1x for the serving
    tail, and needs the references' bytes once, at serve_check, not on top of a build's scratch."""
    from pipeline.build.disk_plan import (BASELINE_FACTOR, HANDTUNED_FACTOR, MARGIN, SCRATCH_FACTOR,
                                          SERVING_TAIL_FACTOR)
    ws = tmp_path / "repo"
    ws.mkdir()
    w = 100 << 20
    plan = plan_run(w, ALL, ws, ws / ".dvc" / "cache", ws, ws, ["hardlink"])
    kept = sum(n.bytes for n in plan.needs if not n.scratch)
    refs, = [n for n in plan.needs if n.what.startswith("serve_check")]
    assert refs.scratch and refs.bytes == int(w * (BASELINE_FACTOR + HANDTUNED_FACTOR))
    assert refs.bytes > max(int(w * f) for f, _ in SCRATCH_FACTOR.values())
    (mount, need), = plan.required.items()
    assert need == pytest.approx((kept + refs.bytes) * MARGIN, abs=len(plan.needs))
    assert [n.bytes for n in plan.needs if n.what.startswith("serving tail")] == [int(w * SERVING_TAIL_FACTOR)]
    # Without the onnx variant there is no hand-tuned reference to pack.
    no_onnx = plan_run(w, ["eager", "torchscript"], ws, ws / ".dvc" / "cache", ws, ws, ["hardlink"])
    assert [n.bytes for n in no_onnx.needs if n.what.startswith("serve_check")] == [int(w * BASELINE_FACTOR)]


def test_already_built_variants_add_nothing(tmp_path):
    ws = tmp_path / "repo"
    ws.mkdir()
    full = plan_run(10 << 20, ALL, ws, ws, tmp_path, tmp_path, ["hardlink"])
    rest = plan_run(10 << 20, ALL, ws, ws, tmp_path, tmp_path, ["hardlink"], already_built=ALL[:-1])
    assert {n.variant for n in rest.needs if n.variant} == {"int8"}
    assert sum(rest.required.values()) < sum(full.required.values())


def test_weight_bytes_counts_weights_not_tokenizers(tmp_path):
    ckpt = write_checkpoint(tmp_path / "model" / "model.safetensors", 1)
    (tmp_path / "model" / "tokenizer.json").write_text("{}" * 1000)
    assert weight_bytes(tmp_path / "model") == ckpt.stat().st_size
    assert weight_bytes(ckpt) == ckpt.stat().st_size


def test_a_half_precision_checkpoint_counts_as_its_fp32_variants_write(tmp_path):
    """Qwen3-Embedding ships bf16: its fp32 variants write twice the checkpoint's bytes."""
    import torch
    from safetensors.torch import save_file
    tensors = {"w": torch.zeros(256, 256), "ids": torch.zeros(100, dtype=torch.int64)}
    save_file(tensors, str(tmp_path / "fp32.safetensors"))
    save_file({"w": tensors["w"].bfloat16(), "ids": tensors["ids"]}, str(tmp_path / "bf16.safetensors"))
    fp32, bf16 = weight_bytes(tmp_path / "fp32.safetensors"), weight_bytes(tmp_path / "bf16.safetensors")
    assert (tmp_path / "bf16.safetensors").stat().st_size < 0.6 * fp32
    assert abs(bf16 - fp32) <= 64                   # the headers' lengths differ, nothing else


def test_convert_stage_stops_before_converting_on_a_small_disk(small_fs):
    """The stage, run from a copy of the repo on the small filesystem, refuses with exit code 2 and
    writes no variant folder."""
    repo = small_fs / "repo"
    repo.mkdir()
    for name in ("pipeline", "stages", "handlers"):
        shutil.copytree(REPO_ROOT / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO_ROOT / "examples" / "tensor", repo / "examples" / "tensor")
    (repo / ".dvc").mkdir()
    shutil.copy(REPO_ROOT / ".dvc" / "config", repo / ".dvc" / "config")
    shutil.copy(REPO_ROOT / "dvc.yaml", repo / "dvc.yaml")
    params = (REPO_ROOT / "examples" / "tensor" / "params.yaml").read_text()
    ckpt = write_checkpoint(small_fs / "big.safetensors", 6)
    import yaml
    doc = yaml.safe_load(params)
    doc["model"]["checkpoint"] = str(ckpt)
    (repo / "params.yaml").write_text(yaml.safe_dump(doc))
    env = {**os.environ, "PIPELINE_CACHE_DIR": str(small_fs / "cache"), "TMPDIR": str(small_fs)}
    env.pop("PIPELINE_STAGE_METRICS", None)
    done = subprocess.run([sys.executable, "-m", "stages.convert", "eager"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "not enough disk for this run" in done.stderr and f"on {small_fs}" in done.stderr
    assert not (repo / "artifacts" / "variants" / "eager").exists()


def test_a_full_disk_is_recognised_from_the_real_error(small_fs):
    from stages.convert import is_disk_full
    with pytest.raises(OSError) as raised:
        with open(small_fs / "filler", "wb") as f:
            for _ in range(64):
                f.write(bytes(1 << 20))
                f.flush()
                os.fsync(f.fileno())
    assert raised.value.errno == errno.ENOSPC
    assert is_disk_full(f"OSError: {raised.value}") and not is_disk_full("ValueError: shapes differ")


def test_footprint_counts_a_hard_link_once(tmp_path):
    a = tmp_path / "a.bin"
    a.write_bytes(os.urandom(1 << 20))
    os.link(a, tmp_path / "b.bin")
    fp = footprint([tmp_path])
    assert fp.files == 2 and fp.bytes == 2 << 20 and fp.linked_files == 2
    assert (1 << 20) <= fp.on_disk_bytes < (2 << 20)


def _reflinks_supported(d: Path) -> bool:
    src = d / "probe"
    src.write_bytes(b"x" * 4096)
    ok = subprocess.run(["cp", "--reflink=always", str(src), str(d / "probe2")], capture_output=True).returncode == 0
    for p in (src, d / "probe2"):
        p.unlink(missing_ok=True)
    return ok


@pytest.mark.parametrize("cache_type", ["hardlink,copy", "reflink,hardlink,copy"])
def test_outputs_are_linked_into_the_cache_after_repro(tmp_path, cache_type):
    """The repo's setting links a directory output's files into DVC's cache. Two ways DVC still leaves
    copies, which the account finds and links by content: reflink first on a filesystem without
    reflinks, and a stage writing bytes the cache already holds (DVC keeps that workspace copy)."""
    dvc = str(Path(sys.executable).parent / "dvc")
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run([dvc, "init", "-q"], cwd=repo, check=True)
    subprocess.run([dvc, "config", "cache.type", cache_type], cwd=repo, check=True)
    (repo / "dvc.yaml").write_text(
        "stages:\n  make:\n    cmd: python -c \"import os; os.makedirs('artifacts/out', exist_ok=True); "
        "open('artifacts/out/a.bin','wb').write(os.urandom(300000))\"\n    outs:\n      - artifacts/out\n"
        "  again:\n    cmd: python -c \"import os, shutil; os.makedirs('artifacts/copy', exist_ok=True); "
        "shutil.copyfile('artifacts/out/a.bin', 'artifacts/copy/a.bin')\"\n    deps:\n      - artifacts/out\n"
        "    outs:\n      - artifacts/copy\n")
    ckpt = write_checkpoint(repo / "ckpt" / "model.safetensors", 1)
    (repo / "params.yaml").write_text(yaml_params(ckpt))
    subprocess.run([dvc, "repro", "-q"], cwd=repo, check=True)
    copy = repo / "artifacts" / "copy" / "a.bin"
    content = copy.read_bytes()
    done = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "disk_account.py"), "--repo", str(repo)],
                          capture_output=True, text=True, timeout=120)
    rec = json.loads((repo / "metrics" / "disk.json").read_text())
    assert done.returncode == 0, done.stderr[-2000:]
    assert rec["unlinked_files"]["after"] == 0
    assert (repo / "artifacts" / "out" / "a.bin").stat().st_nlink == 3 and copy.stat().st_nlink == 3
    assert copy.read_bytes() == content
    if cache_type.startswith("hardlink") or not _reflinks_supported(repo):
        # hardlink first: only the copy of bytes already cached; reflink first on ext4: both files
        expected = 1 if cache_type.startswith("hardlink") else 2
        assert rec["unlinked_files"]["before"] == expected and rec["relinked"] == expected
        assert "artifacts/copy/a.bin" in rec["unlinked_examples"]
    # Workspace + cache hold the 300 kB output once, for both outputs.
    assert 300000 <= rec["outputs"]["artifacts/out"] + rec["outputs"]["artifacts/copy"] < 600000
    assert rec["cache_extra_bytes"] < 300000
    # DVC still sees both outputs as up to date after the relink.
    status = subprocess.run([dvc, "status", "-q"], cwd=repo)
    assert status.returncode == 0


def yaml_params(ckpt: Path) -> str:
    return (REPO_ROOT / "examples" / "tensor" / "params.yaml").read_text().replace(
        "checkpoint: examples/tensor/weights.safetensors", f"checkpoint: {ckpt}")
