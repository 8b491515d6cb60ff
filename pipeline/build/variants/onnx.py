"""`onnx` (fp32) and `onnx-fp16`: model.onnx, optimised at build time, with its weights inside or,
for big models, beside it in model.onnx.data (ONNX external data).

Export: the dynamo exporter first (torch.export underneath, dynamic batch/sequence), the legacy
TorchScript-based exporter as the fallback. Protobuf cannot hold more than 2 GB, so a model whose
fp32 weights reach `conversion.onnx_external_data_mb` (256 MB by default) keeps its tensors in one
external data file, at every step (export, fp16 conversion, ORT's optimised model). Well below the
limit on purpose: ORT memory-maps external data, so such a model loads faster and with a lower peak
RSS than from one file (bytes parsed, tensors copied). The variant lists that file in variant.json ("files",
"external_data"), so verification, the archive and the ONNX handler treat it as part of the model;
ONNX Runtime resolves it relative to model.onnx, so the runtime loads the model by its path.
Text transformers then get their attention fused into ORT's MultiHeadAttention (onnxscript's rules
for the dynamo graph, `conversion.onnx_fusions`, pipeline/build/variants/fusion.py), kept only when the
fused graph gives the export's outputs. The graph is then optimised by ONNX Runtime itself at the
EXTENDED level (operator fusions; not the ALL level, whose NCHWc layout rewrites tie the file to one
CPU's instruction set) for the target device's execution provider, and that optimised graph is the
artifact: sessions load it with
optimisation off (faster start, docs/handtuned.md). fp16: onnxruntime's float16 converter with
`keep_io_types=True`, so the artifact still takes and returns float32.
On CPU a variant with external data also ships ORT's pre-packed weight layout for this host
(`conversion.onnx_prepack`, pipeline/build/variants/prepack.py): sessions map it instead of packing
every weight at load.
"""
from __future__ import annotations

import json
import logging
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from handlers.runtimes.onnx_family import check_providers_active, choose_providers
from pipeline.core.params import Params
from pipeline.build.plan import emulated_dtype_note
from pipeline.build.variants.base import Artifact, BuildContext, Converter, forget_last_export, register
from pipeline.build.variants.export_cache import cached_export, export_key
from pipeline.build.variants.fusion import check_feeds, fuse_attention
from pipeline.build.variants.prepack import PREPACKED_GRAPH, prepack
from pipeline.model.weights import module_bytes

log = logging.getLogger(__name__)
ARTIFACT = "model.onnx"
FUSION_RECORD = "fusion.json"          # the fusion's record, kept with the fused export in the cache
DATA_SUFFIX = ".data"                  # model.onnx -> model.onnx.data (the exporters' convention)
# The dynamo exporter's passes log every step at INFO; keep the conversion log readable.
for _name in ("onnx_ir", "onnxscript", "torch.onnx"):
    logging.getLogger(_name).setLevel(logging.WARNING)


@register
class OnnxConverter(Converter):
    name = "onnx"
    family = "onnx"
    dtype = "float32"
    methods = ("dynamo", "legacy")
    releases_module = True          # after the export (see _build)

    @dataclass(frozen=True)
    class Options:
        opset: int = 18                        # conversion.onnx_opset
        graph_optimization: str = "extended"   # ORT level baked into the artifact: basic | extended
        external_data_min_bytes: int = 256 * 10**6   # fp32 weights from this size on: tensors in model.onnx.data
        prepack: bool = True                   # conversion.onnx_prepack: ship ORT's packed weights (CPU)
        fusions: bool = True                   # conversion.onnx_fusions: attention fused before ORT optimises

    @classmethod
    def host_unsuitable(cls, env: dict) -> Optional[str]:
        return emulated_dtype_note(cls.dtype, env)     # onnx-fp16 on a CPU without native fp16

    @classmethod
    def from_params(cls, params: Params) -> "OnnxConverter":
        return cls(cls.Options(opset=params.conversion.onnx_opset,
                               external_data_min_bytes=int(params.conversion.onnx_external_data_mb * 10**6),
                               prepack=params.conversion.onnx_prepack, fusions=params.conversion.onnx_fusions))

    def build_dynamo(self, ctx: BuildContext) -> Artifact:
        return self._build(ctx, dynamo=True)

    def build_legacy(self, ctx: BuildContext) -> Artifact:
        return self._build(ctx, dynamo=False)

    # ------------------------------------------------------------------ steps
    def _build(self, ctx: BuildContext, dynamo: bool) -> Artifact:
        module = ctx.module()
        external = module_bytes(module) >= self.options.external_data_min_bytes
        raw_dir = ctx.out_dir / "raw"          # the exporters may scatter per-tensor files: all go with it
        raw_dir.mkdir(exist_ok=True)
        raw = raw_dir / "raw.onnx"
        final = ctx.out_dir / ARTIFACT
        try:
            # The cached entry is the export with its attention fused (`_fuse`): the fusion is a function
            # of the export, the fusion code and the golden batches it is checked on, and took ~14 s of
            # each ONNX variant of a 2 GB model (issue 30), so its key holds those too.
            check = check_feeds(ctx.golden) if self.options.fusions else []
            key = export_key(module, self._export_inputs(ctx),
                             {"dynamo": dynamo, "external": external, "opset": self.options.opset, "device": ctx.device,
                              "fusions": self.options.fusions, "fusion_check": _feeds_digest(check)},
                             [Path(__file__), Path(fuse_attention.__code__.co_filename)])
            del module

            def export_and_fuse() -> None:
                self._export(ctx, raw, dynamo, external)
                self._release(ctx)
                (raw_dir / FUSION_RECORD).write_text(json.dumps(self._fuse(ctx, raw, check)))

            export = cached_export(key, raw, export_and_fuse,
                                   lambda: [p for p in (raw, data_file(raw), raw_dir / FUSION_RECORD) if p.is_file()])
            self._release(ctx)
            if (raw_dir / FUSION_RECORD).is_file():
                fusion = json.loads((raw_dir / FUSION_RECORD).read_text())
                if export["reused"] and self.options.fusions:
                    fusion["reused"] = True          # fused (and checked) by the build that kept the entry
            else:                                    # an entry without the fusion's record: fuse here
                fusion = self._fuse(ctx, raw, check)
            self._transform(raw)
            external = self._optimize(ctx, raw, final)     # the artifact's own form (int8 decides by its size)
        finally:
            shutil.rmtree(raw_dir, ignore_errors=True)
        inputs = {s.name: s.dtype for s in ctx.loaded.inputs}   # float32 stays float32 at the boundary
        data = final.name + DATA_SUFFIX
        # The packed layouts go into the external data file: models kept in one file stay as they are.
        packed = prepack(final, data) if self.options.prepack and external and ctx.device == "cpu" else None
        if external and not (ctx.out_dir / data).is_file():
            raise RuntimeError(f"ONNX Runtime did not write the external data file {data} beside {final.name}")
        extra = {"graph_optimized": True, "graph_optimization": self.options.graph_optimization,
                 "opset": self.options.opset, "exporter": "dynamo" if dynamo else "legacy", "export": export,
                 "fusion": fusion, "external_data": [data] if external else []}
        if packed:
            extra["prepacked"] = packed
        return Artifact(ARTIFACT, "onnx", inputs, extra=extra,
                        data_files=([data] if external else []) + ([PREPACKED_GRAPH] if packed else []))

    @staticmethod
    def _export_inputs(ctx: BuildContext) -> dict:
        """What of the inputs the exported graph depends on (the export cache's key)."""
        return {"inputs": [(s.name, str(t.dtype), tuple(t.shape), sorted(s.dynamic_axes.items()))
                           for s, t in zip(ctx.loaded.inputs, ctx.example_inputs())],
                "outputs": list(ctx.loaded.outputs)}

    def _export(self, ctx: BuildContext, path: Path, dynamo: bool, external: bool) -> None:
        loaded = ctx.loaded
        args = ctx.example_inputs()
        names_in = [s.name for s in loaded.inputs]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if dynamo:
                torch.onnx.export(ctx.module(), args, str(path), dynamo=True, external_data=external,
                                  input_names=names_in, output_names=list(loaded.outputs),
                                  dynamic_shapes=ctx.dynamic_shapes(), opset_version=self.options.opset,
                                  verbose=False)
                _rename_shadowed_outputs(path)
            else:
                axes = {s.name: {int(a): n for a, n in s.dynamic_axes.items()} for s in loaded.inputs}
                axes.update({o: {0: "batch"} for o in loaded.outputs})
                torch.onnx.export(ctx.module(), args, str(path), dynamo=False, input_names=names_in,
                                  output_names=list(loaded.outputs), dynamic_axes=axes,
                                  opset_version=self.options.opset)
        forget_last_export()
        if external:
            if not data_file(path).exists():
                # One data file whatever the exporter wrote (the legacy one scatters a file per tensor).
                _save(_load(path), path, external=True)
        elif data_file(path).exists():
            raise RuntimeError(f"the exporter wrote external data beside {path.name} for a model under "
                               f"{self.options.external_data_min_bytes} bytes of weights")

    def _release(self, ctx: BuildContext) -> None:
        """Every step after the export reads the exported graph: the torch module's weights would only
        add a copy of the model to the ONNX steps' own (quantizing needs two)."""
        if ctx.loaded.module is not None and ctx.loaded.release_module():
            log.info("%s: torch module released after the export (the ONNX steps use the graph)", self.name)

    def _fuse(self, ctx: BuildContext, raw: Path, check: list[dict]) -> dict:
        """Attention fused in the fp32 export, checked on `check` (the largest and the smallest golden batch)."""
        if not self.options.fusions:
            return {"applied": False, "reason": "conversion.onnx_fusions is off"}
        data = data_file(raw)
        return fuse_attention(raw, data.name if data.exists() else None, check)

    def _transform(self, path: Path) -> None:
        """Hook for subclasses (fp16); the fp32 variant keeps the exported graph."""

    def _optimize(self, ctx: BuildContext, raw: Path, final: Path, external: Optional[bool] = None) -> bool:
        """ORT's optimised graph of `raw` into `final`, with its tensors in `final`'s data file when
        `external` (default: the form of `raw`); returns whether they are."""
        import onnxruntime as ort
        levels = {"basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                  "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED}
        so = ort.SessionOptions()
        so.graph_optimization_level = levels[self.options.graph_optimization]
        so.optimized_model_filepath = str(final)
        so.log_severity_level = 3
        external = data_file(raw).exists() if external is None else external
        if not external and data_file(raw).exists():
            # ORT would keep the initialisers it does not touch as references into raw's data file.
            _internalize(raw)
        if external:
            # Written beside `final` under this (relative) name; small tensors stay in the graph.
            so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                        final.name + DATA_SUFFIX)
            so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        providers = choose_providers(ctx.device, ort.get_available_providers())
        session = ort.InferenceSession(str(raw), sess_options=so, providers=providers)
        check_providers_active(ctx.device, providers, session.get_providers())
        del session
        if not final.is_file():
            raise RuntimeError(f"ONNX Runtime did not write the optimised model {final}")
        return external


@register
class OnnxFloat16Converter(OnnxConverter):
    name = "onnx-fp16"
    dtype = "float16"

    def _transform(self, path: Path) -> None:
        from onnxruntime.transformers.float16 import convert_float_to_float16
        external = data_file(path).exists()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # it warns for every constant clamped to the fp16 range
            # By path: shape inference then runs file to file on the graph alone; given a loaded
            # model it would return a second in-memory copy of every weight first.
            model = convert_float_to_float16(str(path), keep_io_types=True)
        _save(model, path, external)


def _feeds_digest(feeds: list[dict]) -> str:
    """sha256 of feeds (names, dtypes, shapes, bytes): what the fusion check ran on, for the cache key."""
    import hashlib
    import numpy as np
    h = hashlib.sha256()
    for f in feeds:
        for name in sorted(f):
            a = np.ascontiguousarray(f[name])
            h.update(f"{name}:{a.dtype}:{a.shape}".encode())
            h.update(a.tobytes())
    return h.hexdigest()[:32]


def data_file(model_path: Path) -> Path:
    """The external data file of `model_path` in this module's convention (model.onnx.data)."""
    return model_path.with_name(model_path.name + DATA_SUFFIX)


def onnx_bytes(model_path: Path) -> int:
    """Bytes of a model on disk: the graph file and its external data file, if any."""
    data = data_file(model_path)
    return model_path.stat().st_size + (data.stat().st_size if data.exists() else 0)


def _rename_shadowed_outputs(path: Path) -> None:
    """The dynamo exporter names values after their op (aten.embedding → "embedding"); a graph output
    of the same name then has two definitions, which ONNX Runtime refuses ("Duplicate definition of
    name") — every text model fell back to the legacy exporter, whose in-memory proto peaks at ~3
    extra copies of the weights. The earlier definitions are renamed (with their consumers); the
    graph output keeps its name. Only the graph is rewritten: external data stays where it is."""
    import onnx
    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    outputs = {o.name for o in g.output}
    last = {o: i for i, n in enumerate(g.node) for o in n.output}
    if not any(o in outputs and last[o] != i for i, n in enumerate(g.node) for o in n.output):
        return
    rename: dict[str, str] = {}
    for i, n in enumerate(g.node):
        for j, x in enumerate(n.input):
            n.input[j] = rename.get(x, x)
        for j, o in enumerate(n.output):
            if o in outputs and last[o] != i:
                rename[o] = n.output[j] = f"{o}__shadowed{i}"
            else:
                rename.pop(o, None)
    path.unlink()                  # a new file (see `_save`)
    onnx.save(model, str(path))


def _internalize(path: Path) -> None:
    """Rewrite `path` as one file, its external tensors inside (it must fit protobuf's 2 GB): a new
    file, never the old one's bytes rewritten (it may be a link into the export cache)."""
    import onnx
    model = _load(path)
    path.unlink()
    onnx.save(model, str(path))
    data_file(path).unlink()


def _load(path: Path):
    import onnx
    return onnx.load(str(path))               # with its external data (resolved beside `path`)


def _save(model, path: Path, external: bool) -> None:
    """Save `model` as `path` (+ one data file when external); other files beside it are removed
    first (the tensors are in memory now), so stale per-tensor files never mix in, and `path` too:
    the saved files are new ones, never an old file's bytes rewritten (an export restored from the
    cache is a hard link to the cached copy)."""
    import onnx
    for p in path.parent.iterdir():
        if p.is_file():
            p.unlink()
    onnx.save(model, str(path), save_as_external_data=external, all_tensors_to_one_file=True,
              location=data_file(path).name)

