"""The device-aware plan: a cheap screen that keeps variants which cannot compete on the target
device from spending minutes in verification and benchmarking.

Two inputs, both recorded:
- the ISA flags of artifacts/env.json, through `Converter.host_unsuitable(env)`: e.g. fp16 on a CPU
  without AVX512-FP16/AMX-FP16 is emulated (converted to fp32 per op), bf16 likewise without
  AVX512-BF16/AMX-BF16. A flag only says why a variant may be slow; it never decides alone.
- measured batch-1 calls: once the artifact is built (seconds) and before verification, the golden
  batch-1 input runs through the variant's own runtime (the one serving uses) and the fp32 eager
  module in the same process, alternately, both on ONE thread, each to its steady state
  (pipeline/build/steady.py: warm-ups until the calls settle, then the median of several timed
  calls, all under a time cap per variant). A first call is no verdict: TorchScript's profiling
  executor makes a variant that ends up faster than eager many times slower on its first calls.
  One thread because the ratio is a property of the kernels (emulated fp16 costs the same per op on
  one thread or many), while two thread pools on busy cores measure the scheduler: OpenMP and ONNX
  Runtime workers spin after each call and starve the other side.
  An ONNX build drops the torch module after its export (its steps read the graph; quantizing
  bert-large held 5.7 GB with the module, 4.2 without): eager's calls are then timed just before
  the build, on the same thread count, and the variant's after it.
  A variant whose steady-state call is more than `conversion.screen_max_slowdown` times eager's (and
  slower by more than `MIN_LOSS_S`, so a tiny model's noise decides nothing) is `skipped`:
  conversion.json keeps the measured reason (which says how it was measured), the folder keeps
  nothing loadable, benchmark/select/report treat it like a rejected variant. When the time cap
  ends the screen before a steady state, a variant is skipped only if its calls after warm-up are
  beyond the limit, or, with no such call, its fastest call is beyond `CLEAR_CUT` times the limit.

`conversion.screen: false` builds and verifies every variant whatever the screen would say.
The reference (`eager`) is never screened. On a GPU nothing is measured against the CPU-side eager
module: a variant whose `host_unsuitable` names a reason there is skipped with that reason.

Verification cost is bounded too (`bounded_golden`; not for a task gate): a model of at least `conversion.big_model_mb`
verifies one golden batch per batch size instead of all of them — every batch size still runs once,
which is what catches a batch size baked in by tracing.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from pipeline.build.steady import CAP_S, Series, jit_warmup_calls, measure, measure_alone, time_call

log = logging.getLogger(__name__)

# With the time cap hit before any call past warm-up, a call this many times over the limit still
# decides: no JIT warm-up explains it, and emulated fp16 on a large model costs tens of seconds a call.
CLEAR_CUT = 4
MIN_LOSS_S = 0.010        # a variant at most this much slower per call than eager is never skipped
REFERENCE = "eager"

# dtype -> (ISA flags of env.json cpu.isa any of which computes it natively, how the note names them)
NATIVE_HALF = {"float16": (("avx512_fp16", "amx_fp16"), "AVX512_FP16/AMX-FP16"),
               "bfloat16": (("avx512_bf16", "amx_bf16"), "AVX512_BF16/AMX-BF16")}
SHORT = {"float16": "fp16", "bfloat16": "bf16"}


def emulated_dtype_note(dtype: str, env: dict) -> Optional[str]:
    """Why `dtype` runs emulated on the CPU `env` describes (x86 only: the flags say it), or None."""
    if dtype not in NATIVE_HALF or (env.get("device") or "cpu") != "cpu":
        return None
    cpu = env.get("cpu") or {}
    if cpu.get("arch") not in ("x86_64", "AMD64"):
        return None
    flags, names = NATIVE_HALF[dtype]
    isa = cpu.get("isa") or {}
    if any(isa.get(f) for f in flags):
        return None
    return f"a CPU without {names} ({SHORT[dtype]} is emulated there)"


def read_env(path: Path) -> dict:
    """artifacts/env.json, or {} when the probe has not run (the screen then measures without flags)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


@dataclass(frozen=True)
class Screen:
    """A screen bound to one variant: call it with the built variant folder."""
    variant: str
    dtype: str
    note: Optional[str]                       # host_unsuitable's reason, if any
    max_slowdown: float
    eager_call: Optional[Callable[[], float]]   # one fp32 eager batch-1 call -> seconds; None: not alternated
    feeds: dict
    device: str = "cpu"
    threads: int = 1
    eager_before: Optional[Series] = None      # eager's calls timed before the build (releases_module)
    cap_s: float = CAP_S

    def __call__(self, model_dir: Path) -> dict:
        """{'decision': 'build' | 'skip', 'reason', figures...}; never raises for a slow variant."""
        from handlers.runtimes import load_runtime
        if self.eager_call is None and self.eager_before is None:
            return {"decision": "skip" if self.note else "build", "isa_note": self.note, "seconds": 0.0,
                    "reason": f"{self.variant}: {self.note}" if self.note else "not measured on this device"}
        import torch
        t0 = time.perf_counter()
        torch_threads = torch.get_num_threads()
        runtime = load_runtime(model_dir, device=self.device, threads=self.threads)
        torch.set_num_threads(self.threads)          # the eager side too (a torch runtime already did)
        warmups = runtime.warmup_calls
        if runtime.variant.get("format") == "torchscript":
            warmups = max(warmups, jit_warmup_calls())
        try:
            variant, eager = measure(time_call(lambda: runtime.run(self.feeds)), warmups,
                                     eager_call=self.eager_call, eager=self.eager_before, cap_s=self.cap_s)
        finally:
            runtime.close()
            torch.set_num_threads(torch_threads)     # verification and later builds keep their threads
        return self._record(variant, eager, time.perf_counter() - t0)

    def _record(self, variant: Series, eager: Series, seconds: float) -> dict:
        variant_s, eager_s = variant.figure(), eager.figure()
        slowdown = variant_s / eager_s if eager_s > 0 else float("inf")
        beyond = self._too_slow(variant_s, eager_s)
        # The cap came before a timed call: only a call after warm-up, or one no warm-up explains, decides.
        skip = beyond and (variant.steady or variant.past_warmups or slowdown > CLEAR_CUT * self.max_slowdown)
        where = f" on {self.note}" if self.note else ""
        kept = (f"; built: a cold call skips only beyond {CLEAR_CUT * self.max_slowdown:g}×"
                if beyond and not skip else "")
        return {"decision": "skip" if skip else "build",
                "measured": variant.describe(self.cap_s),
                "eager_call_s": round(eager_s, 5), "variant_call_s": round(variant_s, 5),
                "variant_calls_s": [round(c, 5) for c in variant.calls],
                "eager_calls_s": [round(c, 5) for c in eager.calls],
                "variant": variant.as_dict(), "eager": eager.as_dict(), "cap_s": self.cap_s,
                "slowdown": round(slowdown, 2), "max_slowdown": self.max_slowdown, "isa_note": self.note,
                "seconds": round(seconds, 3),
                "reason": (f"{self.variant} batch-1 call, {variant.describe(self.cap_s)}: {_fmt_s(variant_s)} "
                           f"vs eager {_fmt_s(eager_s)} ({slowdown:.1f}×, limit {self.max_slowdown:g}×){where}{kept}")}

    def _too_slow(self, call_s: float, eager_s: float) -> bool:
        return call_s > self.max_slowdown * eager_s and call_s - eager_s > MIN_LOSS_S


def _fmt_s(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1000:.1f} ms" if seconds >= 0.01 else f"{seconds * 1000:.3f} ms"


def make_screen(converter_cls, params, loaded, golden, env: dict, device: str) -> Optional[Screen]:
    """The screen for one variant, or None when it is not screened (the reference, or
    `conversion.screen: false`)."""
    if converter_cls.name == REFERENCE or not params.conversion.screen:
        return None
    note = converter_cls.host_unsuitable(env)
    if device != "cpu":
        return Screen(variant=converter_cls.name, dtype=converter_cls.dtype, note=note,
                      max_slowdown=params.conversion.screen_max_slowdown, eager_call=None, feeds={}, device=device)
    import torch
    batch1 = min(golden.batches, key=lambda b: b.batch_size)
    args = loaded.example_inputs(batch1.feeds)

    def eager_call() -> float:
        module = loaded.require_module()      # looked up per call: the screen must not keep it alive
        with torch.inference_mode():
            t0 = time.perf_counter()
            module(*args)
            return time.perf_counter() - t0

    if not converter_cls.releases_module:
        return Screen(variant=converter_cls.name, dtype=converter_cls.dtype, note=note,
                      max_slowdown=params.conversion.screen_max_slowdown, eager_call=eager_call,
                      feeds=batch1.feeds, device=device)
    # The build will drop the module: eager's calls are timed now, and the screen holds no module.
    threads = torch.get_num_threads()
    torch.set_num_threads(Screen.threads)
    try:
        before = measure_alone(eager_call)
    finally:
        torch.set_num_threads(threads)
    return Screen(variant=converter_cls.name, dtype=converter_cls.dtype, note=note,
                  max_slowdown=params.conversion.screen_max_slowdown, eager_call=None,
                  feeds=batch1.feeds, device=device, eager_before=before)


def bounded_golden(golden, loaded, params, tol=None):
    """The golden set verification runs: all of it, or for a model of at least
    `conversion.big_model_mb` the first batch of each batch size (every size still runs once).
    A task gate (int8: recall@k of the reference's neighbours) always gets all of it: it judges the
    set as a whole, and k shrinks with the samples — on a 1.3 GB model recall@3 over 15 samples
    passed a variant whose recall@8 over the 33 samples was 0.947, which serve_check's HTTP parity
    then refused (0.928)."""

    from pipeline.model.weights import module_bytes
    size_mb = module_bytes(loaded.module) / 2**20
    if size_mb < params.conversion.big_model_mb or (tol is not None and tol.gate == "task"):
        return golden
    kept, seen = [], set()
    for b in golden.batches:
        if b.batch_size not in seen:
            seen.add(b.batch_size)
            kept.append(b)
    log.info("model of %.0f MB >= conversion.big_model_mb %s: verifying %d golden batches (one per batch "
             "size %s) instead of %d", size_mb, params.conversion.big_model_mb, len(kept), sorted(seen),
             len(golden.batches))
    return dataclasses.replace(golden, batches=kept)
