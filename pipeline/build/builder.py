"""Build one variant folder: convert → assemble (variant.json, extra files) → verify → record.

`build_variant` tries the converter's methods in order and keeps the first that verifies; every
outcome writes `conversion.json` (docs/artifacts.md):
- converted: the folder holds the artifact, variant.json, the task's extra files;
- rejected: an artifact was built but missed the golden set (the reason names the worst element);
- failed: no artifact could be built (the reason is the real exception; the traceback tail is kept).
- skipped: the plan's screen (pipeline/build/plan.py) measured the built artifact's batch-1 call too slow
  against eager's on this device, at the steady state or past the screen's time cap; verification
  never ran (the reason holds the figures and says which was measured).
A folder that is not `converted` keeps only conversion.json, so nothing downstream can load it.
Conversion, screen and verification seconds are recorded separately (`conversion_s`, `screen_s`,
`verification_s`).

`convert_isolated` runs all of it in its own process (`python -m pipeline.build.worker`) with a
time limit: a hung or crashing conversion is killed and recorded as failed, never stops the others.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

from pipeline.model.loaded import free_memory
from pipeline.core.params import REPO_ROOT, Tolerance
from pipeline.build.variants.base import Artifact, BuildContext, Converter
from pipeline.accuracy.verify import Verification, fp16_range_violation, verify_variant

log = logging.getLogger(__name__)

CONVERSION_JSON = "conversion.json"
VARIANT_JSON = "variant.json"
TRACEBACK_LINES = 12


def exception_reason(e: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(e), e)).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    return first[:500]


def traceback_tail(e: BaseException) -> list[str]:
    lines = "".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip().splitlines()
    return lines[-TRACEBACK_LINES:]


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, allow_nan=True) + "\n")
    os.replace(tmp, path)


def clear_dir(path: Path, keep: tuple[str, ...] = ()) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for p in path.iterdir():
        if p.name in keep:
            continue
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def variant_json(converter: Converter, artifact: Artifact, loaded, device: str, method: str) -> dict:
    extra_names = sorted(loaded.extra_files)
    return {
        "variant": converter.name, "family": converter.family, "format": artifact.format,
        "artifact": artifact.file, "dtype": converter.dtype, "device": device,
        "inputs": [{"name": s.name, "dtype": artifact.input_dtypes[s.name]} for s in loaded.inputs],
        "outputs": [{"name": n} for n in loaded.outputs],
        "task": loaded.task,
        "files": [*artifact.files, VARIANT_JSON, *extra_names],
        "method": method,
        **artifact.extra,
    }


def assemble(out_dir: Path, converter: Converter, artifact: Artifact, loaded, device: str, method: str) -> dict:
    for name, src in loaded.extra_files.items():
        shutil.copyfile(src, out_dir / name)
    meta = variant_json(converter, artifact, loaded, device, method)
    write_json(out_dir / VARIANT_JSON, meta)
    return meta


def base_record(variant: str, dtype: Optional[str], tol: Optional[Tolerance]) -> dict:
    return {"variant": variant, "status": "failed", "reason": "", "conversion_s": None, "artifact_bytes": None,
            "dtype": dtype,
            "tolerance": dataclasses.asdict(tol) if tol else None,
            "verification": None}


def failure_record(variant: str, dtype: Optional[str], tol: Optional[Tolerance], reason: str,
                   tb: Optional[list[str]] = None) -> dict:
    record = base_record(variant, dtype, tol)
    record.update(status="failed", reason=reason)
    if tb:
        record["traceback"] = tb
    return record


def build_variant(converter: Converter, loaded, golden, out_dir: str | Path, device: str, tol: Tolerance,
                  min_topk_agreement: float, threads: Optional[int] = None,
                  screen: Optional[Callable[[Path], dict]] = None) -> dict:
    """Convert with each method in turn until one verifies; write and return conversion.json.
    `screen(out_dir)` (pipeline.build.plan) runs between building and verifying; 'skip' ends the variant."""
    out_dir = Path(out_dir)
    ctx = BuildContext(loaded=loaded, golden=golden, out_dir=out_dir, device=device)
    attempts: list[dict] = []
    chosen: Optional[dict] = None
    overflow = fp16_range_violation(converter.dtype, golden)
    if overflow:
        attempts.append({"method": "range-check", "status": "rejected", "reason": overflow})
        log.info("%s: rejected before building — %s", converter.name, overflow)
    for method in converter.methods if not overflow else ():
        clear_dir(out_dir)
        attempt: dict = {"method": method}
        attempts.append(attempt)
        t0 = time.perf_counter()
        try:
            artifact = converter.build(method, ctx)
            attempt["conversion_s"] = round(time.perf_counter() - t0, 3)
            # What the build held (traced, frozen, optimised copies) goes back to the OS before the
            # screen and verification load the artifact: torchscript's build peaked at 4.2 GB without.
            free_memory()
            assemble(out_dir, converter, artifact, loaded, device, method)
            attempt["artifact_bytes"] = sum((out_dir / f).stat().st_size for f in artifact.files)
            attempt["format"] = artifact.format
            if "quantization" in artifact.extra:      # int8: what was quantized, what stayed fp32, and why
                attempt["quantization"] = artifact.extra["quantization"]
        except Exception as e:
            attempt.update(status="failed", reason=exception_reason(e), traceback=traceback_tail(e),
                           conversion_s=round(time.perf_counter() - t0, 3))
            log.warning("%s/%s failed: %s", converter.name, method, attempt["reason"])
            continue
        try:
            if screen is not None:
                attempt["screen"] = screen(out_dir)
                attempt["screen_s"] = attempt["screen"]["seconds"]
                log.info("%s/%s: screen: %s — %s", converter.name, method, attempt["screen"]["decision"],
                         attempt["screen"]["reason"])
                if attempt["screen"]["decision"] == "skip":
                    attempt.update(status="skipped", reason=attempt["screen"]["reason"])
                    break
            # Verification runs the artifact against the golden outputs: the torch module would only
            # add a copy of the weights to the artifact's (a later method loads it again).
            ctx.loaded.release_module()
            v: Verification = verify_variant(out_dir, golden, tol, min_topk_agreement, device=device, threads=threads)
            attempt["verification_s"] = round(v.seconds, 3)
        except Exception as e:   # the runtime cannot even load it
            attempt.update(status="failed", reason="loading the built artifact failed: " + exception_reason(e),
                           traceback=traceback_tail(e))
            log.warning("%s/%s: %s", converter.name, method, attempt["reason"])
            continue
        attempt.update(status="converted" if v.passed else "rejected", reason=v.reason,
                       verification=v.as_dict())
        log.info("%s/%s: %s — %s", converter.name, method, attempt["status"], v.reason)
        if v.passed:
            chosen = attempt
            break
        if not converter.retry_rejected:
            log.info("%s: %s's rejection ends the attempts (another method builds the same computation)",
                     converter.name, method)
            break

    record = base_record(converter.name, converter.dtype, tol)
    if chosen is None:
        clear_dir(out_dir)     # nothing loadable stays behind; conversion.json says why
        skipped = [a for a in attempts if a["status"] == "skipped"]     # a skip ends the attempts
        rejected = skipped or [a for a in attempts if a["status"] == "rejected"]
        status = rejected[0]["status"] if rejected else "failed"
        main = rejected[0] if rejected else attempts[0]
        reason = (main["reason"] if status == "skipped"        # the screen's measured reason, as it is
                  else " | ".join(f"{a['method']}: {a['status']}: {a['reason']}" for a in attempts))
        record.update(status=status, reason=reason, conversion_s=main.get("conversion_s"),
                      artifact_bytes=main.get("artifact_bytes"), verification=main.get("verification"))
        if status == "failed":
            record["traceback"] = main.get("traceback")
        record.update(screen=main.get("screen"), screen_s=main.get("screen_s"),
                      verification_s=main.get("verification_s"))
    else:
        record.update(status="converted", reason=chosen["reason"], conversion_s=chosen["conversion_s"],
                      artifact_bytes=chosen["artifact_bytes"], verification=chosen["verification"],
                      format=chosen["format"], screen=chosen.get("screen"), screen_s=chosen.get("screen_s"),
                      verification_s=chosen.get("verification_s"))
    if (chosen or main).get("quantization") is not None:
        record["quantization"] = (chosen or main)["quantization"]
    record.update(method=(chosen or {}).get("method"), device=device, options=converter.options_dict(),
                  attempts=[{k: v for k, v in a.items() if k not in ("verification", "quantization")}
                            for a in attempts])
    write_json(out_dir / CONVERSION_JSON, record)
    return record


# --------------------------------------------------------------------------- isolation
def convert_isolated(variant: str, out_dir: str | Path, golden_dir: str | Path, timeout_s: float,
                     dtype: Optional[str] = None, tol: Optional[Tolerance] = None) -> dict:
    """Run `pipeline.build.worker` for `variant` in a fresh process (its own process group) and
    return its conversion.json. Timeout → the group is killed, status failed. The child inherits the
    environment, so $PIPELINE_PARAMS selects the same params file."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CONVERSION_JSON).unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pipeline.build.worker", variant, "--out", str(out_dir),
           "--golden", str(golden_dir)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        clear_dir(out_dir)
        record = failure_record(variant, dtype, tol, f"timed out after {timeout_s:g} s "
                                f"(conversion.timeout_s); raise it if this conversion is expected to be slow")
        record["conversion_s"] = round(time.perf_counter() - t0, 3)
        write_json(out_dir / CONVERSION_JSON, record)
        return record
    path = out_dir / CONVERSION_JSON
    if rc != 0 or not path.is_file():
        how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
        clear_dir(out_dir)
        record = failure_record(variant, dtype, tol, f"the conversion process died ({how}) before recording "
                                f"a result; see its log above")
        write_json(path, record)
        return record
    return json.loads(path.read_text())


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)    # the worker and anything it started (compilers)
    except ProcessLookupError:
        pass
    proc.wait()


def stage_exit_code(variant: str, status: str) -> int:
    """Only the reference may fail the stage: every other variant's miss is a recorded result.
    eager counts as failed unless converted — without a verified fp32 baseline nothing else is trusted."""
    return 1 if variant == "eager" and status != "converted" else 0
