"""params.yaml's rules across fields, once the types hold: one check per section, each raising
`ParamsError` with the key, the value and what is allowed."""
from __future__ import annotations

import re
from typing import Any, Callable, Iterable

from pipeline.core.fleet_params import check_fleet
from pipeline.core.params import INT8_VARIANTS, VARIANTS, Params
from pipeline.core.params_typed import ParamsError, bad_value

MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-.]*")


def _bounds(section: str, rules: Iterable[tuple[str, Any, bool, str]]) -> None:
    """(key, value, holds, allowed) rows: the first that does not hold is the error."""
    for key, value, ok, allowed in rules:
        if not ok:
            raise bad_value(f"{section}.{key}", value, allowed)


def check_variants(p: Params) -> None:
    for i, v in enumerate(p.variants):
        if v not in VARIANTS:
            raise bad_value(f"variants[{i}]", v, ", ".join(VARIANTS))
    if len(set(p.variants)) != len(p.variants):
        raise bad_value("variants", p.variants, "each variant at most once")
    if "eager" not in p.variants:
        raise bad_value("variants", p.variants,
                        "a list that includes 'eager' (the reference every variant is checked against)")


def check_model(p: Params) -> None:
    m = p.model
    if m.source == "state_dict" and not m.factory:
        raise ParamsError("params.yaml: `model.factory` is required when `model.source` is 'state_dict' "
                          "(e.g. `pkg.module:build` or `path/to/file.py:build`)")
    if m.factory and ":" not in m.factory:
        raise bad_value("model.factory", m.factory, "'pkg.module:function' or 'path/to/file.py:function'")
    if m.text.max_texts < 1:
        raise bad_value("model.text.max_texts", m.text.max_texts, "an integer >= 1 (texts one request may carry)")
    if m.task == "tensor":
        if not m.input_shape:
            raise ParamsError("params.yaml: `model.input_shape` is required when `model.task` is 'tensor' "
                              "(the shape of ONE sample, batch dimension excluded, e.g. [16, 32])")
        if any(d <= 0 for d in m.input_shape):
            raise bad_value("model.input_shape", m.input_shape, "positive dimensions")


def _sides(value: Any) -> list:
    return [value] if isinstance(value, int) else list(value)


def _channels(value: Any) -> list:
    return [value] * 3 if isinstance(value, (int, float)) else list(value)


def check_image(p: Params) -> None:
    """model.image for image-classification: a fixed input size, and mean/std on the scale of the pixels."""
    if p.model.task != "image-classification":
        return
    img = p.model.image
    for key in ("size", "crop_size"):
        value = getattr(img, key)
        if value is not None and (len(_sides(value)) not in (1, 2) or any(s < 1 for s in _sides(value))):
            raise bad_value(f"model.image.{key}", value, "a positive integer (square) or [height, width]")
    if img.size is not None and img.resize_shortest_edge is not None:
        raise bad_value("model.image.size", img.size, "null when model.image.resize_shortest_edge is set "
                        "(size resizes to exactly that; resize_shortest_edge keeps the aspect ratio)")
    if img.resize_shortest_edge is not None and (img.resize_shortest_edge < 1 or img.crop_size is None):
        raise bad_value("model.image.resize_shortest_edge", img.resize_shortest_edge,
                        "a positive integer, with model.image.crop_size set (the model takes one fixed size; "
                        "e.g. resize_shortest_edge: 256, crop_size: 224)")
    for key in ("mean", "std"):
        value = getattr(img, key)
        if value is not None and len(_channels(value)) != 3:
            raise bad_value(f"model.image.{key}", value, "one number, or three: [R, G, B]")
    if img.std is not None and any(s <= 0 for s in _channels(img.std)):
        raise bad_value("model.image.std", img.std, "positive numbers")
    std = _channels(128.0 if img.std is None else img.std)
    if img.rescale_factor is not None and img.rescale_factor <= 0:
        raise bad_value("model.image.rescale_factor", img.rescale_factor, "a positive number, e.g. 0.00392156862745098 (1/255)")
    if img.rescale_factor is None and max(std) < 1:
        raise bad_value("model.image.std", img.std, "values on the pixels' 0..255 scale (std < 1 is a 0..1 scale: "
                        "set model.image.rescale_factor: 0.00392156862745098, i.e. 1/255, to rescale the pixels first)")
    if img.rescale_factor is not None and img.rescale_factor < 0.5 and max(std) > 2:
        raise bad_value("model.image.std", img.std, f"values on the scale of the rescaled pixels (x "
                        f"{img.rescale_factor}), e.g. [0.229, 0.224, 0.225]; null means 128, for 0..255 pixels")
    _bounds("model.image", (
        ("top_k", img.top_k, img.top_k >= 1, "an integer >= 1"),
        ("max_pixels", img.max_pixels, img.max_pixels >= 1, "a positive number of pixels, e.g. 50000000")))


def check_model_name(p: Params) -> None:
    if MODEL_NAME.fullmatch(p.model.name) is None:
        raise bad_value("model.name", p.model.name, "letters, digits, '_', '-', '.', starting with a letter or digit")


def check_benchmark(p: Params) -> None:
    b = p.benchmark
    if not b.batch_sizes or any(s <= 0 for s in b.batch_sizes):
        raise bad_value("benchmark.batch_sizes", b.batch_sizes, "a non-empty list of positive integers")
    if sorted(set(b.batch_sizes)) != b.batch_sizes:
        raise bad_value("benchmark.batch_sizes", b.batch_sizes, "strictly increasing sizes")
    _bounds("benchmark", (
        ("cold_runs", b.cold_runs, b.cold_runs >= 1, "an integer >= 1"),
        ("steady_runs", b.steady_runs, b.steady_runs >= 1, "an integer >= 1 (3 or more to see cross-process noise)"),
        ("budget_s", b.budget_s, b.budget_s >= 0, "seconds >= 0 (0: every cold run and steady round, however long)"),
        ("interleave_passes", b.interleave_passes, b.interleave_passes >= 1, "an integer >= 1"),
        ("warmup_iters", b.warmup_iters, b.warmup_iters >= 0, "an integer >= 0"),
        ("warmup_max_s", b.warmup_max_s, b.warmup_max_s >= 0, "seconds >= 0"),
        ("min_iters", b.min_iters, b.min_iters >= 1, "an integer >= 1"),
        ("min_duration_s", b.min_duration_s, b.min_duration_s >= 0, "seconds >= 0"),
        ("max_cv", b.max_cv, b.max_cv > 0, "a positive ratio, e.g. 0.15"),
        ("point_max_s", b.point_max_s, b.point_max_s >= 0, "seconds >= 0 (0: every point takes min_iters calls)"),
        ("rounds_agree_within", b.rounds_agree_within, 0 <= b.rounds_agree_within < 1,
         "a ratio in [0, 1), e.g. 0.03 (0: every round budget_s allows)"),
        ("sweep_patience", b.sweep_patience, b.sweep_patience >= 1, "an integer >= 1"),
        ("latency_cap_ms", b.latency_cap_ms, b.latency_cap_ms > 0, "a positive number of milliseconds"),
        ("text_length", b.text_length, b.text_length >= 1, "a positive number of tokens")))


def check_conversion(p: Params) -> None:
    c = p.conversion
    _bounds("conversion", (
        ("screen_max_slowdown", c.screen_max_slowdown, c.screen_max_slowdown > 1,
         "a ratio > 1, e.g. 4 (skip a variant whose batch-1 call is 4x eager's)"),
        ("big_model_mb", c.big_model_mb, c.big_model_mb >= 0, "MB >= 0 (0: every model verifies one batch per size)"),
        ("onnx_external_data_mb", c.onnx_external_data_mb, 0 <= c.onnx_external_data_mb <= 1800,
         "MB in [0, 1800] (0: always external data; protobuf cannot hold 2 GB, and the optimiser adds initialisers)")))
    for dtype in ("float32", "float16", "bfloat16"):
        if dtype not in c.tolerances:
            raise bad_value("conversion.tolerances", sorted(c.tolerances), "float32, float16 and bfloat16 all present")


def check_tolerances(p: Params) -> None:
    listed = [v for v in p.variants if v in INT8_VARIANTS]
    if listed and "int8" not in p.conversion.tolerances:
        raise bad_value("conversion.tolerances", sorted(p.conversion.tolerances),
                        f"an `int8` entry too, since variants lists {listed} (e.g. int8: {{atol: 0.05, rtol: 0.1, "
                        f"min_cosine: 0.995, gate: task, min_recall_at_k: 0.95}})")
    for dtype, t in p.conversion.tolerances.items():
        key = f"conversion.tolerances.{dtype}"
        for name in ("min_recall_at_k", "min_top1_agreement", "min_topk_overlap", "min_cosine"):
            if not 0.0 <= getattr(t, name) <= 1.0:
                raise bad_value(f"{key}.{name}", getattr(t, name), "a share in [0, 1]")
        for name in ("recall_k", "topk"):
            if getattr(t, name) < 1:
                raise bad_value(f"{key}.{name}", getattr(t, name), "an integer >= 1")


def check_int8(p: Params) -> None:
    q = p.conversion.int8
    alpha = q.smoothing_alpha
    _bounds("conversion.int8", (
        ("calibration_samples", q.calibration_samples, q.calibration_samples >= 8, "an integer >= 8"),
        ("sensitivity_budget_s", q.sensitivity_budget_s, q.sensitivity_budget_s >= 0,
         "seconds >= 0 (0: no fallback, the whole model is quantized)"),
        ("max_fp32_share", q.max_fp32_share, 0.0 <= q.max_fp32_share <= 1.0, "a share in [0, 1]"),
        ("smoothing_alpha", alpha,
         alpha in ("auto", None) or (isinstance(alpha, (int, float)) and not isinstance(alpha, bool)
                                     and 0.0 < alpha < 1.0),
         "auto, null (off) or a migration strength in (0, 1), e.g. 0.7")))


def check_serve(p: Params) -> None:
    sv = p.serve
    _bounds("serve", (
        ("latency_slo_ms", sv.latency_slo_ms, sv.latency_slo_ms > 0, "a positive number of milliseconds"),
        ("expected_concurrency", sv.expected_concurrency, sv.expected_concurrency >= 1,
         "an integer >= 1 (requests in flight in production)"),
        ("memory_share", sv.memory_share, 0 < sv.memory_share <= 1, "a share in (0, 1], e.g. 0.8"),
        ("max_workers_per_gpu", sv.max_workers_per_gpu, sv.max_workers_per_gpu >= 1, "an integer >= 1"),
        ("target_disk_read_mb_s", sv.target_disk_read_mb_s,
         sv.target_disk_read_mb_s is None or sv.target_disk_read_mb_s > 0,
         "null (the read speed measured on this host) or a positive MB/s, e.g. 200"),
        ("folder_store_min_mb", sv.folder_store_min_mb, sv.folder_store_min_mb >= 0,
         "MB >= 0 (0: always serve from the unpacked folder)")))
    cap = p.benchmark.latency_cap_ms
    if sv.latency_slo_ms > cap:
        # The sweep stops after the first batch past the cap: a batch the SLO could serve beyond it
        # would never be measured, and selection would not know it.
        raise bad_value("serve.latency_slo_ms", sv.latency_slo_ms,
                        f"at most benchmark.latency_cap_ms ({cap:g} ms): the benchmark's sweep stops after the "
                        f"first batch whose p99 passes the cap, so batches this SLO could serve would go "
                        f"unmeasured; raise benchmark.latency_cap_ms too (the benchmarks then run again)")


def check_tune(p: Params) -> None:
    t = p.tune
    _bounds("tune", (
        ("rounds", t.rounds, t.rounds >= 1, "an integer >= 1 (2 or more to see the noise)"),
        ("max_rounds", t.max_rounds, t.max_rounds >= t.rounds, f"an integer >= tune.rounds ({t.rounds})"),
        ("measure_s", t.measure_s, t.measure_s > 0, "seconds > 0"),
        ("warmup_requests", t.warmup_requests, t.warmup_requests >= 0, "an integer >= 0"),
        ("max_candidates", t.max_candidates, t.max_candidates >= 1, "an integer >= 1"),
        ("contenders", t.contenders, t.contenders >= 1, "an integer >= 1 (1: serve selection's winner only)")))


def check_serve_check(p: Params) -> None:
    sc = p.serve_check
    _bounds("serve_check", (
        ("rounds", sc.rounds, sc.rounds >= 1, "an integer >= 1"),
        ("requests", sc.requests, sc.requests >= 1, "an integer >= 1"),
        ("concurrency", sc.concurrency, sc.concurrency >= 1, "an integer >= 1 (keep-alive clients)"),
        ("time_cap_s", sc.time_cap_s, sc.time_cap_s > 0, "seconds > 0"),
        ("warmup_s", sc.warmup_s, sc.warmup_s >= 0, "seconds >= 0 (0: no warm-up)"),
        ("decided_band", sc.decided_band, sc.decided_band >= 0,
         "a ratio >= 0, e.g. 0.25 (0: every round for every setup)"),
        ("rerank_clients", sc.rerank_clients, sc.rerank_clients >= 1, "an integer >= 1 (keep-alive clients)"),
        ("rerank_texts", sc.rerank_texts, sc.rerank_texts >= 1, "an integer >= 1 (texts per rerank query)")))


# Run in this order, the first failing check's error the one reported: a params file with several
# mistakes always names the same one first.
CHECKS: tuple[Callable[[Params], None], ...] = (
    check_variants, check_model, check_image, check_benchmark, check_conversion, check_tolerances, check_int8,
    check_serve, check_tune, check_serve_check, check_model_name)


def check_semantics(p: Params) -> None:
    for check in CHECKS:
        check(p)
    check_fleet(p.fleet)                    # its own module: pipeline/core/fleet_params.py
