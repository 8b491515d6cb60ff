"""params.yaml's rules once the types hold: the numeric range of every number (RANGES, data), then
the rules across fields (one check per section). Each yields `Problem`s; all of them are reported
together. Checks that read files (the checkpoint, the factory): pipeline/core/params_inputs.py."""
from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from pipeline.core.fleet_params import check_fleet
from pipeline.core.params_schema import INT8_VARIANTS, TEXT_TASKS, VARIANTS, ImageParams, Params, TextParams
from pipeline.core.params_typed import MISSING, Problem

MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-.]*")


# --------------------------------------------------------------------------- ranges (data)
@dataclass(frozen=True)
class Range:
    """A number's allowed interval; `example_bad` is a value outside it (the table test uses it)."""
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    allowed: str = ""

    def holds(self, v: float) -> bool:
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        if self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi):
            return False
        return True

    @property
    def example_bad(self) -> float:
        return (self.lo - 1) if self.lo is not None else (self.hi + 1)


def at_least(n: int, what: str = "") -> Range:
    return Range(lo=n, allowed=f"an integer >= {n}" + (f" ({what})" if what else ""))


def seconds(lo_open: bool = True, what: str = "") -> Range:
    return Range(lo=0, lo_open=lo_open, allowed=("seconds > 0" if lo_open else "seconds >= 0") + (f" ({what})" if what else ""))


def positive(unit: str, what: str = "") -> Range:
    return Range(lo=0, lo_open=True, allowed=f"a positive number of {unit}" + (f" ({what})" if what else ""))


def non_negative(unit: str, what: str = "") -> Range:
    return Range(lo=0, allowed=f"{unit} >= 0" + (f" ({what})" if what else ""))


SHARE = Range(lo=0, hi=1, allowed="a share in [0, 1]")
SHARE_OPEN_LOW = Range(lo=0, hi=1, lo_open=True, allowed="a share in (0, 1], e.g. 0.8")
RATIO_BELOW_1 = Range(lo=0, hi=1, hi_open=True, allowed="a ratio in [0, 1), e.g. 0.03")
PORT = Range(lo=1, hi=65535, allowed="a TCP port in [1, 65535]")

# Every number in the schema, by its dotted path (`<name>`: any key of a mapping, `[]`: any item).
# tests/core/test_params_table.py holds that no numeric field is missing here or from CUSTOM.
RANGES: dict[str, Range] = {
    "model.text.max_length": at_least(1, "tokens per text"),
    "model.text.max_texts": at_least(1, "texts one request may carry"),
    "model.image.top_k": at_least(1),
    "model.image.max_pixels": at_least(1, "pixels, e.g. 50000000"),
    "model.image.resize_shortest_edge": at_least(1, "pixels"),
    "model.image.rescale_factor": positive("x", "e.g. 0.00392156862745098, i.e. 1/255"),
    "conversion.timeout_s": at_least(1, "seconds per variant's conversion"),
    "conversion.onnx_opset": Range(lo=13, hi=23, allowed="an ONNX opset in [13, 23], e.g. 18"),
    "conversion.onnx_external_data_mb": Range(lo=0, hi=1800, allowed="MB in [0, 1800] (0: always external data; "
                                              "protobuf cannot hold 2 GB, and the optimiser adds initialisers)"),
    "conversion.tolerances.<name>.atol": non_negative("an absolute tolerance"),
    "conversion.tolerances.<name>.rtol": non_negative("a relative tolerance"),
    "conversion.tolerances.<name>.min_cosine": SHARE,
    "conversion.tolerances.<name>.min_recall_at_k": SHARE,
    "conversion.tolerances.<name>.recall_k": at_least(1),
    "conversion.tolerances.<name>.min_top1_agreement": SHARE,
    "conversion.tolerances.<name>.min_topk_overlap": SHARE,
    "conversion.tolerances.<name>.topk": at_least(1),
    "conversion.tolerances.<name>.min_ndcg": SHARE,
    "conversion.tolerances.<name>.min_entity_f1": SHARE,
    "conversion.min_topk_agreement": SHARE,
    "conversion.golden_seed": at_least(0),
    "conversion.golden_batches": at_least(1, "distinct batches per batch size"),
    "conversion.screen_max_slowdown": Range(lo=1, lo_open=True, allowed="a ratio > 1, e.g. 4 (skip a variant whose "
                                            "batch-1 call is 4x eager's)"),
    "conversion.big_model_mb": non_negative("MB", "0: every model verifies one batch per size"),
    "conversion.int8.calibration_samples": at_least(8),
    "conversion.int8.sensitivity_budget_s": seconds(False, "0: no fallback, the whole model is quantized"),
    "conversion.int8.max_fp32_share": SHARE,
    "benchmark.threads": at_least(0, "0: what one serving worker gets"),
    "benchmark.cold_runs": at_least(1),
    "benchmark.steady_runs": at_least(1, "3 or more to see cross-process noise"),
    "benchmark.budget_s": seconds(False, "0: every cold run and steady round, however long"),
    "benchmark.rounds_agree_within": RATIO_BELOW_1,
    "benchmark.interleave_passes": at_least(1),
    "benchmark.warmup_iters": at_least(0),
    "benchmark.warmup_max_s": seconds(False),
    "benchmark.min_iters": at_least(1),
    "benchmark.min_duration_s": seconds(False),
    "benchmark.point_max_s": seconds(False, "0: every point takes min_iters calls"),
    "benchmark.max_cv": Range(lo=0, lo_open=True, allowed="a positive ratio, e.g. 0.15"),
    "benchmark.min_gain": non_negative("a ratio"),
    "benchmark.sweep_patience": at_least(1),
    "benchmark.latency_cap_ms": positive("milliseconds"),
    "benchmark.text_length": at_least(1, "tokens"),
    "serve.latency_slo_ms": positive("milliseconds"),
    "serve.memory_budget_mb": positive("MB per worker"),
    "serve.max_cold_load_s": positive("seconds", "or null: no limit"),
    "serve.target_disk_read_mb_s": positive("MB/s", "or null: the read speed measured on this host"),
    "serve.folder_store_min_mb": non_negative("MB", "0: always serve from the unpacked folder"),
    "serve.startup_safety": Range(lo=1, allowed="a factor >= 1"),
    "serve.startup_margin_s": seconds(False),
    "serve.startup_floor_s": at_least(1, "seconds"),
    "serve.response_safety": Range(lo=1, allowed="a factor >= 1"),
    "serve.response_floor_s": at_least(1, "seconds"),
    "serve.expected_concurrency": at_least(1, "requests in flight in production"),
    "serve.min_batch_gain": non_negative("a ratio", "e.g. 0.05"),
    "serve.noise_floor": RATIO_BELOW_1,
    "serve.delay_headroom_share": SHARE,
    "serve.worker_import_s": seconds(False),
    "serve.memory_share": SHARE_OPEN_LOW,
    "serve.max_workers_per_gpu": at_least(1),
    "serve.inference_port": PORT,
    "serve.management_port": PORT,
    "serve.metrics_port": PORT,
    "serve.overrides.batch_size": at_least(1, "requests per batch"),
    "serve.overrides.batch_rows": at_least(1, "rows per model call"),
    "serve.overrides.max_batch_delay_ms": at_least(0, "milliseconds"),
    "serve.overrides.workers": at_least(1, "worker processes"),
    "serve.overrides.threads_per_worker": at_least(1, "intra-op threads per worker"),
    "serve.overrides.startup_timeout_s": at_least(1, "seconds"),
    "serve.overrides.response_timeout_s": at_least(1, "seconds"),
    "serve.overrides.job_queue_size": at_least(1, "requests"),
    "serve.overrides.max_request_size": at_least(1, "bytes"),
    "serve.overrides.max_response_size": at_least(1, "bytes"),
    "tune.rounds": at_least(1, "2 or more to see the noise"),
    "tune.max_rounds": at_least(1),
    "tune.measure_s": seconds(),
    "tune.warmup_requests": at_least(0),
    "tune.max_candidates": at_least(1),
    "tune.contenders": at_least(1, "1: serve selection's winner only"),
    "serve_check.requests": at_least(1),
    "serve_check.concurrency": at_least(1, "keep-alive clients; null: serve.expected_concurrency"),
    "serve_check.time_cap_s": seconds(),
    "serve_check.warmup_s": seconds(False, "0: no warm-up"),
    "serve_check.rounds": at_least(1),
    "serve_check.decided_band": non_negative("a ratio", "e.g. 0.25; 0: every round for every setup"),
    "serve_check.rerank_texts": at_least(1, "texts per rerank query"),
    "serve_check.rerank_clients": at_least(1, "keep-alive clients"),
    "fleet.schedule_timeout_s": seconds(),
    "fleet.targets[].requires.gpu_memory_mb": at_least(1, "or null"),
    "fleet.targets[].requires.memory_mb": at_least(1, "or null"),
    "fleet.targets[].requires.cpus": at_least(1, "or null"),
    "fleet.targets[].ray.resources.<name>": positive("units"),
}

# Numbers whose rule is more than an interval: checked by the functions below.
CUSTOM = {"model.input_shape", "model.image.size", "model.image.crop_size", "model.image.mean", "model.image.std",
          "benchmark.batch_sizes", "conversion.int8.smoothing_alpha"}


def numeric_values(obj: Any, path: str = "", pattern: str = "") -> Iterator[tuple[str, str, Any]]:
    """(key, pattern, value) of every number held by a schema object (None and bools excluded)."""
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            key, pat = (f"{path}.{f.name}" if path else f.name), (f"{pattern}.{f.name}" if pattern else f.name)
            if pat in CUSTOM:
                continue
            yield from numeric_values(getattr(obj, f.name), key, pat)
    elif isinstance(obj, dict):
        typed = any(dataclasses.is_dataclass(v) or isinstance(v, (int, float)) for v in obj.values())
        if typed and not pattern.endswith("factory_kwargs"):
            for k, v in obj.items():
                yield from numeric_values(v, f"{path}.{k}", f"{pattern}.<name>")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from numeric_values(v, f"{path}[{i}]", f"{pattern}[]")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield path, pattern, obj


def check_ranges(p: Params) -> Iterator[Problem]:
    for key, pattern, value in numeric_values(p):
        rule = RANGES.get(pattern)
        if rule is not None and not rule.holds(value):
            yield Problem(key, value, rule.allowed)


# --------------------------------------------------------------------------- rules across fields
def check_variants(p: Params) -> Iterator[Problem]:
    for i, v in enumerate(p.variants):
        if v not in VARIANTS:
            yield Problem(f"variants[{i}]", v, ", ".join(VARIANTS))
    if len(set(p.variants)) != len(p.variants):
        yield Problem("variants", p.variants, "each variant at most once")
    if "eager" not in p.variants:
        yield Problem("variants", p.variants,
                      "a list that includes 'eager' (the reference every variant is checked against)")


def check_model(p: Params) -> Iterator[Problem]:
    m = p.model
    if m.source == "state_dict" and not m.factory:
        yield Problem("model.factory", MISSING, "required when `model.source` is 'state_dict': the function that builds "
                      "the model, e.g. `pkg.module:build` or `path/to/file.py:build`")
    if m.factory and ":" not in m.factory:
        yield Problem("model.factory", m.factory, "'pkg.module:function' or 'path/to/file.py:function'")
    if m.factory and m.source != "state_dict":
        yield Problem("model.factory", m.factory, f"null with `model.source: {m.source}` (only state_dict is built by "
                      f"a factory): remove it, or set model.source: state_dict")
    if m.factory_kwargs and m.source != "state_dict":
        yield Problem("model.factory_kwargs", m.factory_kwargs, f"{{}} with `model.source: {m.source}` (they are "
                      f"model.factory's arguments): remove them")
    if m.task in TEXT_TASKS and m.source != "hf":
        yield Problem("model.source", m.source, f"'hf' for task {m.task!r}: a text task needs a Hugging Face folder "
                      f"(config.json, weights, tokenizer.json); use task 'tensor' for a model without a tokenizer")
    if m.task == "tensor":
        if not m.input_shape:
            yield Problem("model.input_shape", MISSING, "required when `model.task` is 'tensor': the shape of "
                          "ONE sample, batch dimension excluded, e.g. [16, 32]")
        elif any(d <= 0 for d in m.input_shape):
            yield Problem("model.input_shape", m.input_shape, "positive dimensions")
    elif m.input_shape is not None:
        yield Problem("model.input_shape", m.input_shape, f"null for task {m.task!r} (only task 'tensor' reads it): "
                      f"remove it")
    if m.task not in TEXT_TASKS and m.text != TextParams():
        yield Problem("model.text", _set_keys(m.text, TextParams()), f"unset for task {m.task!r} (only text tasks "
                      f"read it): remove it")
    if m.task != "image-classification" and m.image != ImageParams():
        yield Problem("model.image", _set_keys(m.image, ImageParams()), f"unset for task {m.task!r} (only "
                      f"image-classification reads it): remove it")
    if MODEL_NAME.fullmatch(m.name) is None:
        yield Problem("model.name", m.name, "letters, digits, '_', '-', '.', starting with a letter or digit")


def _set_keys(obj: Any, default: Any) -> dict:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if getattr(obj, f.name) != getattr(default, f.name)}


def _sides(value: Any) -> list:
    return [value] if isinstance(value, int) else list(value)


def _channels(value: Any) -> list:
    return [value] * 3 if isinstance(value, (int, float)) else list(value)


def check_image(p: Params) -> Iterator[Problem]:
    """model.image for image-classification: a fixed input size, and mean/std on the scale of the pixels."""
    if p.model.task != "image-classification":
        return
    img = p.model.image
    for key in ("size", "crop_size"):
        value = getattr(img, key)
        if value is not None and (len(_sides(value)) not in (1, 2) or any(s < 1 for s in _sides(value))):
            yield Problem(f"model.image.{key}", value, "a positive integer (square) or [height, width]")
    if img.size is not None and img.resize_shortest_edge is not None:
        yield Problem("model.image.size", img.size, "null when model.image.resize_shortest_edge is set "
                      "(size resizes to exactly that; resize_shortest_edge keeps the aspect ratio)")
    if img.resize_shortest_edge is not None and img.crop_size is None:
        yield Problem("model.image.resize_shortest_edge", img.resize_shortest_edge,
                      "set together with model.image.crop_size (the model takes one fixed size; "
                      "e.g. resize_shortest_edge: 256, crop_size: 224)")
    for key in ("mean", "std"):
        value = getattr(img, key)
        if value is not None and len(_channels(value)) != 3:
            yield Problem(f"model.image.{key}", value, "one number, or three: [R, G, B]")
    if img.std is not None and any(s <= 0 for s in _channels(img.std)):
        yield Problem("model.image.std", img.std, "positive numbers")
        return
    std = _channels(128.0 if img.std is None else img.std)
    if img.rescale_factor is None and max(std) < 1:
        yield Problem("model.image.std", img.std, "values on the pixels' 0..255 scale (std < 1 is a 0..1 scale: "
                      "set model.image.rescale_factor: 0.00392156862745098, i.e. 1/255, to rescale the pixels first)")
    if img.rescale_factor is not None and 0 < img.rescale_factor < 0.5 and max(std) > 2:
        yield Problem("model.image.std", img.std, f"values on the scale of the rescaled pixels (x "
                      f"{img.rescale_factor}), e.g. [0.229, 0.224, 0.225]; null means 128, for 0..255 pixels")


def check_benchmark(p: Params) -> Iterator[Problem]:
    b = p.benchmark
    if not b.batch_sizes or any(s <= 0 for s in b.batch_sizes):
        yield Problem("benchmark.batch_sizes", b.batch_sizes, "a non-empty list of positive integers")
    elif sorted(set(b.batch_sizes)) != b.batch_sizes:
        yield Problem("benchmark.batch_sizes", b.batch_sizes, "strictly increasing sizes, e.g. [1, 2, 4, 8]")


def check_conversion(p: Params) -> Iterator[Problem]:
    c = p.conversion
    for dtype in ("float32", "float16", "bfloat16"):
        if dtype not in c.tolerances:
            yield Problem("conversion.tolerances", sorted(c.tolerances), "float32, float16 and bfloat16 all present")
            break
    listed = [v for v in p.variants if v in INT8_VARIANTS]
    if listed and "int8" not in c.tolerances:
        yield Problem("conversion.tolerances", sorted(c.tolerances),
                      f"an `int8` entry too, since variants lists {listed} (e.g. int8: {{atol: 0.05, rtol: 0.1, "
                      f"min_cosine: 0.995, gate: task, min_recall_at_k: 0.95}})")
    alpha = c.int8.smoothing_alpha
    if not (alpha in ("auto", None) or (isinstance(alpha, (int, float)) and not isinstance(alpha, bool)
                                        and 0.0 < alpha < 1.0)):
        yield Problem("conversion.int8.smoothing_alpha", alpha, "auto, null (off) or a migration strength in (0, 1), "
                      "e.g. 0.7")


def check_serve(p: Params) -> Iterator[Problem]:
    sv = p.serve
    cap = p.benchmark.latency_cap_ms
    if sv.latency_slo_ms > cap:
        # The sweep stops after the first batch past the cap: a batch the SLO could serve beyond it
        # would never be measured, and selection would not know it.
        yield Problem("serve.latency_slo_ms", sv.latency_slo_ms,
                      f"at most benchmark.latency_cap_ms ({cap:g} ms): the benchmark's sweep stops after the "
                      f"first batch whose p99 passes the cap, so batches this SLO could serve would go "
                      f"unmeasured; raise benchmark.latency_cap_ms too (the benchmarks then run again)")
    if sv.allow_quantized and p.benchmark.inexact == "brief":
        # An inexact variant may then win: it needs the figures every other contender has.
        yield Problem("serve.allow_quantized", True,
                      "set together with benchmark.inexact: full, so that the variants it lets win are measured "
                      "as fully as the others (with brief they get 2 rounds; their benchmarks run again)")
    ports = {"inference_port": sv.inference_port, "management_port": sv.management_port,
             "metrics_port": sv.metrics_port}
    if len(set(ports.values())) != len(ports):
        yield Problem("serve.inference_port", ports, "three different ports (inference, management, metrics)")
    o = sv.overrides
    if o.batch_size is not None and o.batch_size > 1 and o.max_batch_delay_ms == 0:
        yield Problem("serve.overrides.max_batch_delay_ms", 0, f"> 0 with batch_size {o.batch_size} (a batch is "
                      f"never waited for at 0 ms, so it would always be 1), or batch_size: 1")


SERVERS = ("torchserve", "ray-serve")


def check_servers(p: Params) -> Iterator[Problem]:
    servers = p.servers
    for i, name in enumerate(servers):
        if name not in SERVERS:
            yield Problem(f"servers[{i}]", name, ", ".join(SERVERS))
    if "torchserve" not in servers:
        yield Problem("servers", servers, "a list holding torchserve (the .mar is the first output; "
                                                      "ray-serve is proven beside it)")
    if len(set(servers)) != len(servers):
        yield Problem("servers", servers, "each server at most once")


def check_tune(p: Params) -> Iterator[Problem]:
    t = p.tune
    if t.max_rounds < t.rounds:
        yield Problem("tune.max_rounds", t.max_rounds, f"an integer >= tune.rounds ({t.rounds})")


# Run in this order, the problems reported in it: a params file with several mistakes always lists
# them the same way.
CHECKS: tuple[Callable[[Params], Iterator[Problem]], ...] = (
    check_variants, check_model, check_image, check_ranges, check_benchmark, check_conversion, check_serve,
    check_tune, check_servers, lambda p: check_fleet(p.fleet))


def check_semantics(p: Params) -> list[Problem]:
    return [problem for check in CHECKS for problem in check(p)]


def schema_numeric_patterns() -> set[str]:
    """Every numeric field's pattern in the schema (the table test compares it with RANGES | CUSTOM)."""
    out = set()

    def numeric(tp: Any) -> bool:
        args = typing.get_args(tp) or (tp,)
        return any(a in (int, float) for a in args) or any(typing.get_origin(a) is list and numeric(typing.get_args(a)[0])
                                                           for a in args)

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key, tp = f"{prefix}.{f.name}" if prefix else f.name, hints[f.name]
            origin = typing.get_origin(tp)
            if dataclasses.is_dataclass(tp):
                walk(tp, key)
            elif origin is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
                walk(typing.get_args(tp)[1], key + ".<name>")
            elif origin is dict and typing.get_args(tp)[1] in (int, float):
                out.add(key + ".<name>")
            elif origin is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
                walk(typing.get_args(tp)[0], key + "[]")
            elif numeric(tp):
                out.add(key)

    walk(Params, "")
    return out
