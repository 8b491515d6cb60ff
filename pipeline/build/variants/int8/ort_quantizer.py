"""ONNX Runtime's quantizer, kept to one copy of the model's weights and not repeating itself.

All are patches of ORT 1.31's Python quantizer (onnxruntime.quantization), each active only for
one quantize_dynamic / calibration call of pipeline/build/variants/int8/onnx_int8.py (`_patched` restores ORT's own):

- `one_model_copy()`: in dynamic mode the quantizer refreshes its shape information by deep-copying
  the model, saving the copy and loading it again (`save_and_reload_model_with_shape_infer`), while
  the model it loaded first is still referenced: three copies of the weights at once. The
  replacement runs the same ONNX shape inference over a skeleton of the graph (weights reduced to
  their types and shapes) and gives the model back with the inferred value_info and ORT's "shapes
  inferred" mark.
- `calibrate_to_cache()`: quantize_static calibrates with the model it loaded still held, a second
  copy loaded by the calibrator, and a session over it that pre-packs the weights again.
  Calibrating first, over the graph alone (the session reads the weights from their data file and
  does not pre-pack them), and handing quantize_static the ranges through its calibration cache
  leaves one copy at a time.
- `PerChannelWeightCache`: memoizes the per-channel weight quantization across the sensitivity
  attempts of one build, which re-quantize the same weights with a different set kept fp32.
"""
from __future__ import annotations

import contextlib
import logging

log = logging.getLogger(__name__)

# Initializers at most this big keep their bytes in the skeleton: shape inference reads the values
# of small constant inputs (Reshape's shape, Slice's bounds); a weight only needs its shape.
SKELETON_KEEPS_BYTES = 1024


@contextlib.contextmanager
def _patched(*replacements):
    """Inside: each (owner, name, replacement) set; ORT's own objects restored on the way out."""
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in replacements]
    for owner, name, replacement in replacements:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def infer_shapes_in_place(model):
    """`model` itself, with the value_info ONNX shape inference gives it (ORT's options: no type
    check, not strict, no data propagation) and ORT's quantizer metadata — without copying a weight."""
    import onnx
    from onnx import helper
    from onnxruntime.quantization.quant_utils import add_infer_metadata
    g = model.graph
    # A weight enters the skeleton as its type and shape, its bytes "external" (never read: shape
    # inference reads values only of the small constants kept whole).
    initializers = [t if t.ByteSize() <= SKELETON_KEEPS_BYTES else _bytes_elsewhere(t) for t in g.initializer]
    # The value_info already there goes in too: inference keeps it (ORT's optimiser reads it).
    graph = helper.make_graph(g.node, g.name, g.input, g.output, initializer=initializers, value_info=g.value_info)
    skeleton = helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    skeleton.functions.extend(model.functions)
    inferred = onnx.shape_inference.infer_shapes(skeleton, check_type=False, strict_mode=False, data_prop=False)
    del g.value_info[:]
    g.value_info.extend(inferred.graph.value_info)
    add_infer_metadata(model)
    return model


def _bytes_elsewhere(t):
    import onnx
    skeleton = onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims,
                                data_location=onnx.TensorProto.EXTERNAL)
    skeleton.external_data.add(key="location", value="not-loaded")
    return skeleton


@contextlib.contextmanager
def one_model_copy():
    """Inside: ORT's quantizer refreshes shapes with infer_shapes_in_place instead of a save and reload."""
    from onnxruntime.quantization import base_quantizer, onnx_quantizer
    patched = [m for m in (onnx_quantizer, base_quantizer) if hasattr(m, "save_and_reload_model_with_shape_infer")]
    if len(patched) < 2:        # another ORT: still correct, only the memory saving is lost
        log.warning("onnxruntime.quantization no longer reloads the model the way this patch expects; "
                    "quantizing without it")
    with _patched(*[(m, "save_and_reload_model_with_shape_infer", infer_shapes_in_place) for m in patched]):
        yield


def _load_graph_with_shape_infer(model_path):
    """ORT's load_model_with_shape_infer without loading the external weights."""
    import onnx
    from onnxruntime.quantization.quant_utils import add_infer_metadata, generate_identified_filename
    inferred = generate_identified_filename(model_path, "-inferred")
    onnx.shape_inference.infer_shapes_path(str(model_path), str(inferred))
    model = onnx.load(str(inferred), load_external_data=False)
    add_infer_metadata(model)
    inferred.unlink()
    return model


def _session_without_prepacking(calibrator):
    import onnxruntime
    so = onnxruntime.SessionOptions()
    so.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL   # as ORT's calibrator
    so.add_session_config_entry("session.disable_prepacking", "1")    # a few calibration runs: not worth a copy
    calibrator.infer_session = onnxruntime.InferenceSession(calibrator.augmented_model_path, sess_options=so,
                                                            providers=calibrator.execution_providers)


def calibrate_to_cache(src, reader, op_types: list, method, cache_path) -> None:
    """Calibrate `src` (an external-data graph) as quantize_static would and write the ranges to
    `cache_path`, which quantize_static(calibration_cache_path=...) then reads instead of calibrating.
    The augmented graph is written beside `src`, so its weight references still resolve."""
    from pathlib import Path

    from onnxruntime.quantization import calibrate, quant_utils
    src = Path(src)
    augmented = src.with_name("augmented.onnx")
    try:
        with _patched((quant_utils, "load_model_with_shape_infer", _load_graph_with_shape_infer),
                      (calibrate, "load_model_with_shape_infer", _load_graph_with_shape_infer),
                      (calibrate.CalibraterBase, "create_inference_session", _session_without_prepacking)):
            calibrator = calibrate.create_calibrator(src, op_types, augmented_model_path=str(augmented),
                                                     calibrate_method=method, use_external_data_format=True)
            calibrator.collect_data(reader)
            ranges = calibrator.compute_data()
            del calibrator
        calibrate.save_tensors_data(ranges, Path(cache_path), smooth_quant=False)
    finally:
        for p in (augmented, augmented.with_name(augmented.name + ".data")):
            p.unlink(missing_ok=True)


class PerChannelWeightCache:
    """Memoizes ONNX Runtime's per-channel weight quantization (ORT 1.31 quantizes each channel in
    its own Python call: most of a big model's quantize_dynamic) for the sensitivity attempts of
    one build, which re-quantize the same weights with a different set kept fp32. A hit adds the same scale / zero-point / int8 initializers ORT would have."""

    def __init__(self):
        self._store: dict[tuple, tuple[tuple, list]] = {}
        self.hits = self.misses = 0

    @contextlib.contextmanager
    def active(self, scope: str):
        from onnxruntime.quantization.base_quantizer import BaseQuantizer
        original = BaseQuantizer.quantize_weight_per_channel_impl
        cache = self

        def memoized(quantizer, weight_name, weight_qType, channel_axis, reduce_range=True,  # noqa: N803
                     keep_float_weight=False):
            key = (scope, weight_name, weight_qType, channel_axis, reduce_range, keep_float_weight,
                   quantizer.reduce_range, quantizer.is_weight_symmetric(weight_qType),
                   getattr(quantizer, "min_real_range", None),
                   bool(quantizer.tensor_quant_overrides.get_per_channel_overrides(weight_name, default_val=None)))
            hit = cache._store.get(key)
            if hit is not None:
                cache.hits += 1
                quantizer.model.initializer_extend(hit[1])          # copied in by protobuf
                return hit[0]
            cache.misses += 1
            names = original(quantizer, weight_name, weight_qType, channel_axis, reduce_range, keep_float_weight)
            added = {i.name: i for i in quantizer.model.initializer()[-3:]}
            made = [added[n] for n in (names[2], names[1], names[0]) if n in added]   # scale, zp, weight
            if len(made) == (2 if keep_float_weight else 3):
                cache._store[key] = (names, [_copy_proto(t) for t in made])
            return names

        with _patched((BaseQuantizer, "quantize_weight_per_channel_impl", memoized)):
            yield self


def _copy_proto(t):
    c = type(t)()
    c.CopyFrom(t)
    return c
