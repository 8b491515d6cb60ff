"""Ship ONNX Runtime's pre-packed weights with a CPU ONNX variant, so a session maps them instead of
packing them at every load.

On CPU, ORT re-lays each MatMul/Gemm weight out for its kernels when a session is created
(pre-packing), and for a big model that packing is most of a session's creation; the packed layout
saved at build time is mapped instead, for the same steady latency. ORT writes that layout into the data
file beside the original weights (`session.save_external_prepacked_constant_initializers`), with
a graph whose initialisers name it (`prepacked_N` external-data keys).

The variant then holds:
- `model.onnx.data`: every weight, plus the packed layouts (the file grows by the packed bytes);
- `model.prepacked.onnx`: the graph ORT saved, pointing at the packed layouts;
- `model.onnx`: the same graph without those pointers — portable, ORT packs at load as usual.
variant.json "prepacked": {"artifact", "host", "weights", "packed_bytes"}; `host` is
handlers.runtimes.onnx_family.packing_host() of the build host, and the runtime takes the prepacked graph
only where its own packing_host() is equal (the layout belongs to ORT's version and the CPU
features MLAS dispatches on: an AVX2 host must not read an AVX-512 layout).
Verification and benchmarks therefore run the prepacked graph on the build host.
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Optional

from handlers.runtimes.onnx_family import packing_host

log = logging.getLogger(__name__)

PREPACKED_GRAPH = "model.prepacked.onnx"
PACKED_KEY = "prepacked_"               # ORT's external-data key for a packed layout


def _packed_keys(tensor) -> list:
    return [e for e in tensor.external_data if e.key.startswith(PACKED_KEY)]


def prepack(final: Path, data_name: str) -> Optional[dict]:
    """Rewrite the optimised CPU model `final` (graph optimisation already baked in) as the three
    files above; returns variant.json's "prepacked" record, or None when ORT packed no weight (the
    variant is left as it was, e.g. fp16 graphs whose kernels do not pre-pack)."""
    import onnx
    import onnxruntime as ort
    work = final.parent / "prepack"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        saved = work / final.name
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL   # the artifact is optimised
        so.optimized_model_filepath = str(saved)
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", data_name)
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
        ort.InferenceSession(str(final), sess_options=so, providers=["CPUExecutionProvider"])
        model = onnx.load(str(saved), load_external_data=False)
        packed = [t for t in model.graph.initializer if _packed_keys(t)]
        if not packed:
            log.info("%s: ONNX Runtime pre-packs no weight of this graph; the variant stays as built", final.name)
            return None
        for t in packed:                    # the portable graph: same weights, no packed layouts
            for e in _packed_keys(t):
                t.external_data.remove(e)
        old_bytes = sum(p.stat().st_size for p in (final, final.with_name(data_name)) if p.exists())
        onnx.save(model, str(work / "portable.onnx"))
        os.replace(work / data_name, final.with_name(data_name))
        os.replace(saved, final.with_name(PREPACKED_GRAPH))
        os.replace(work / "portable.onnx", final)
        new_bytes = sum(p.stat().st_size for p in (final, final.with_name(data_name)))
        record = {"artifact": PREPACKED_GRAPH, "host": packing_host(), "weights": len(packed),
                  "packed_bytes": new_bytes - old_bytes}
        log.info("%s: %d weights pre-packed for this host (+%.0f MB in %s)", final.name, len(packed),
                 record["packed_bytes"] / 1e6, data_name)
        return record
    finally:
        shutil.rmtree(work, ignore_errors=True)
