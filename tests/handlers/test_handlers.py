"""The TorchServe handlers driven the way TorchServe drives them: the real `ts.context.Context`, the
real request parsing of `ts.service.Service`, and the real response encoder — on tiny variant
folders built here (TorchScript, torch.export eager, fp16, ONNX) for every task."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import ts
from ts.context import Context
from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl
from ts.protocol.otf_message_handler import create_predict_response
from ts.service import Service

from handlers.onnx_handler import OnnxHandler
from handlers.serving import HandlerSetupError, handler_settings, resolve_device
from handlers.torch_handler import TorchHandler

REPO = Path(__file__).resolve().parents[2]
TENSOR_SHAPE = [3, 4]
IMAGE_SIZE = 16
WORDS = ["hello", "world", "guitar", "man", "plays", "a", "the", "market", "fell", "today", "someone", "music"]


# --------------------------------------------------------------------------- tiny models
class TinyTensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 5)

    def forward(self, x):
        return torch.tanh(self.fc(x.flatten(1)))


class TinyEmbedder(nn.Module):
    """Embedding + masked mean pooling + L2 normalisation (what the text wrapper computes)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, 8)
        self.proj = nn.Linear(8, 6)

    def forward(self, input_ids, attention_mask):
        hidden = self.proj(self.emb(input_ids))
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return torch.nn.functional.normalize(pooled, dim=1)


class TinyClassifier(nn.Module):
    def __init__(self, classes: int = 7):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2)
        self.fc = nn.Linear(4, classes)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean(dim=(2, 3)))


def build_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(str(path))


TASKS = {
    "tensor": dict(make=TinyTensor, inputs=[("input", "float32")], outputs=["output"],
                   task={"kind": "tensor", "input_shape": TENSOR_SHAPE, "input_dtype": "float32"}),
    "text-embedding": dict(make=lambda: TinyEmbedder(4 + len(WORDS)), inputs=[("input_ids", "int64"), ("attention_mask", "int64")],
                           outputs=["embedding"],
                           task={"kind": "text-embedding", "max_length": 16, "pooling": "mean", "normalize": True,
                                 "dim": 6, "tokenizer": "tokenizer.json"}),
    "image-classification": dict(make=TinyClassifier, inputs=[("pixels", "float32")], outputs=["logits"],
                                 task={"kind": "image-classification", "input_size": [IMAGE_SIZE, IMAGE_SIZE],
                                       "preprocess": {"resize": {"shortest_edge": IMAGE_SIZE + 4}, "resample": "bicubic",
                                                      "crop": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                                      "rescale_factor": 1 / 255, "mean": [0.5, 0.4, 0.3],
                                                      "std": [0.2, 0.3, 0.25]},
                                       "top_k": 3, "num_classes": 7, "labels": [f"label{i}" for i in range(7)],
                                       "function": "softmax"}),
}


def example_inputs(kind: str, batch: int = 2):
    if kind == "tensor":
        return (torch.randn(batch, *TENSOR_SHAPE),)
    if kind == "text-embedding":
        ids = torch.randint(4, 4 + len(WORDS), (batch, 5))
        return ids, torch.ones_like(ids)
    return (torch.randn(batch, 3, IMAGE_SIZE, IMAGE_SIZE),)


def make_variant(root: Path, kind: str, fmt: str, dtype: str = "float32", seed: int = 0) -> tuple[Path, nn.Module]:
    """A variant folder as the convert stage writes it (docs/artifacts.md), plus its fp32 reference."""
    spec = TASKS[kind]
    torch.manual_seed(seed)
    model = spec["make"]().eval()
    folder = root / f"{kind}-{fmt}-{dtype}"
    folder.mkdir(parents=True)
    files = ["variant.json"]
    task = dict(spec["task"])
    if kind == "text-embedding":
        build_tokenizer(folder / "tokenizer.json")
        files.append("tokenizer.json")
    example = example_inputs(kind)
    names = [n for n, _ in spec["inputs"]]
    in_dtypes = [d if d != "float32" else dtype for _, d in spec["inputs"]]
    family = "onnx" if fmt == "onnx" else "torch"
    with torch.no_grad():
        if fmt == "torchscript":
            m = model.half() if dtype == "float16" else model
            ex = tuple(e.half() if e.is_floating_point() and dtype == "float16" else e for e in example)
            artifact = "model.pt"
            torch.jit.save(torch.jit.trace(m, ex), str(folder / artifact))
            torch.manual_seed(seed)          # the fp32 reference (half() converted the traced one)
            model = spec["make"]().eval()
        elif fmt == "eager":
            artifact = "model.pt2"
            batch = torch.export.Dim("batch", min=1, max=64)
            dyn = tuple({0: batch} for _ in names)
            if kind == "text-embedding":
                seq = torch.export.Dim("seq", min=2, max=64)
                dyn = tuple({0: batch, 1: seq} for _ in names)
            prog = torch.export.export(model, example, dynamic_shapes=dyn)
            torch.export.save(prog, str(folder / artifact))
        else:
            artifact = "model.onnx"
            axes = {n: {0: "batch", 1: "seq"} if kind == "text-embedding" else {0: "batch"} for n in names}
            axes.update({o: {0: "batch"} for o in spec["outputs"]})
            torch.onnx.export(model, example, str(folder / artifact), input_names=names,
                              output_names=spec["outputs"], dynamic_axes=axes, dynamo=False, opset_version=17)
    files.append(artifact)
    variant = {"variant": f"{fmt}-{dtype}", "family": family, "format": fmt, "artifact": artifact, "dtype": dtype,
               "device": "cpu", "inputs": [{"name": n, "dtype": d} for n, d in zip(names, in_dtypes)],
               "outputs": [{"name": o} for o in spec["outputs"]], "task": task, "files": files}
    (folder / "variant.json").write_text(json.dumps(variant, indent=2))
    return folder, model


# --------------------------------------------------------------------------- TorchServe-like driving
def make_context(model_dir: Path, handler_cfg: dict | None = None, batch_size: int = 4, gpu=None) -> Context:
    manifest = {"model": {"modelName": "m", "handler": "h.py", "modelVersion": "1.0"}}
    yaml_cfg = {"minWorkers": 1, "handler": handler_cfg} if handler_cfg is not None else {}
    metrics = MetricsCacheYamlImpl(os.path.join(os.path.dirname(ts.__file__), "configs", "metrics.yaml"))
    metrics.initialize_cache()
    return Context("m", str(model_dir), manifest, batch_size, gpu, ts.__version__, metrics=metrics,
                   model_yaml_config=yaml_cfg)


def wire_value(body: bytes, content_type: str):
    """What TorchServe's worker hands the handler for a body (ts/protocol/otf_message_handler.py)."""
    if content_type == "application/json":
        try:
            return json.loads(body.decode("utf-8"))
        except Exception:
            return body
    if content_type.startswith("text"):
        try:
            return body.decode("utf-8")
        except Exception:
            return body
    return body


def serve_batch(handler, context: Context, requests: list[tuple[bytes, str]]):
    """One batch through the real request parsing → handle → real response encoder.
    Returns [(status, decoded JSON body)] in request order."""
    batch = [{"requestId": f"req-{i}".encode(), "headers": [],
              "parameters": [{"name": "body", "contentType": ct, "value": wire_value(body, ct)}]}
             for i, (body, ct) in enumerate(requests)]
    headers, input_batch, req_map = Service.retrieve_data_for_inference(batch)
    context.request_ids, context.request_processor = req_map, headers
    context.metrics.request_ids = req_map
    out = handler.handle(input_batch, context)
    assert isinstance(out, list) and len(out) == len(requests)
    assert create_predict_response(out, req_map, "Prediction success", 200, context=context)
    return [(context.get_response_status(i)[0], json.loads(o if isinstance(o, (bytes, bytearray)) else json.dumps(o)))
            for i, o in enumerate(out)]


def load(handler_cls, folder: Path, **cfg):
    h = handler_cls()
    h.initialize(make_context(folder, {"threads": 1, "warmup_batch_size": 2, **cfg}))
    return h


def png(seed: int, width: int = 20, height: int = 20) -> bytes:
    from PIL import Image
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB").save(buf, format="PNG")
    return buf.getvalue()


def reference(kind: str, model: nn.Module, folder: Path, body: bytes, ct: str):
    """Expected response from the fp32 model via the task adapter (what prepare's golden does)."""
    from handlers.tasks import make_adapter
    variant = json.loads((folder / "variant.json").read_text())
    adapter = make_adapter(folder, variant["task"])
    feeds = adapter.collate([adapter.decode(body, ct)])
    with torch.no_grad():
        out = model(*[torch.from_numpy(feeds[i["name"]]) for i in variant["inputs"]])
    return adapter.respond([out.numpy()], 0)


def close_enough(got, want, atol):
    if isinstance(want, list) and want and isinstance(want[0], dict):       # [{"label", "score"}] best first
        assert [c["label"] for c in got] == [c["label"] for c in want]
        np.testing.assert_allclose([c["score"] for c in got], [c["score"] for c in want], atol=atol)
    elif isinstance(want, dict):
        np.testing.assert_allclose(got["embedding"], want["embedding"], atol=atol)
    else:
        np.testing.assert_allclose(got, want, atol=atol)


VALID = {
    "tensor": lambda i: (json.dumps(np.round(np.random.default_rng(i).standard_normal(TENSOR_SHAPE), 4).tolist()).encode(),
                         "application/json"),
    "text-embedding": lambda i: ((" ".join(WORDS[: 2 + i]).encode(), "text/plain") if i % 2 == 0 else
                                 (json.dumps({"text": " ".join(WORDS[i:])}).encode(), "application/json")),
    "image-classification": lambda i: (png(i, 18 + i, 30 - 3 * i), "image/png"),
}
MALFORMED = {
    "tensor": [(b"[[1, 2", "application/json"), (json.dumps([[1.0] * 4] * 2).encode(), "application/json"),
               (json.dumps([["a"] * 4] * 3).encode(), "application/json"), (b"", "application/json")],
    "text-embedding": [(json.dumps({"text": ""}).encode(), "application/json"), (b"{not json", "application/json"),
                       (b"   ", "text/plain")],
    "image-classification": [(b"definitely not an image", "image/png"), (b"", "image/jpeg"),
                             (json.dumps({"x": 1}).encode(), "application/json"),
                             (json.dumps({"inputs": "@@@"}).encode(), "application/json")],
}
CASES = [("tensor", "torchscript", "float32"), ("tensor", "eager", "float32"), ("tensor", "torchscript", "float16"),
         ("tensor", "onnx", "float32"),
         ("text-embedding", "torchscript", "float32"), ("text-embedding", "onnx", "float32"),
         ("text-embedding", "eager", "float32"),
         ("image-classification", "torchscript", "float32"), ("image-classification", "onnx", "float32")]


@pytest.mark.parametrize("kind,fmt,dtype", CASES, ids=["-".join(c) for c in CASES])
def test_batch_mixing_valid_and_malformed_requests(tmp_path, kind, fmt, dtype):
    folder, model = make_variant(tmp_path, kind, fmt, dtype)
    handler_cls = OnnxHandler if fmt == "onnx" else TorchHandler
    t0 = time.perf_counter()
    h = load(handler_cls, folder)
    init_ms = (time.perf_counter() - t0) * 1000.0
    ms = h.load_breakdown_ms
    assert h.initialized
    assert {"import", "read", "deserialize", "warmup_bs2", "total"} <= set(ms)
    # runtime + adapter + warm-up make the total (each rounded to 0.01 ms); the runtime's own phases
    # lie inside its part; the whole fits in initialize as timed from outside.
    assert ms["runtime_total"] + ms["adapter"] + ms["warmup_bs2"] == pytest.approx(ms["total"], abs=0.02)
    assert ms["import"] + ms["read"] + ms["deserialize"] + ms["to_device"] <= ms["runtime_total"] + 0.02
    assert 0 < ms["warmup_bs2"] and ms["total"] <= init_ms
    ctx = make_context(folder, {"threads": 1})
    valid = [VALID[kind](i) for i in range(3)]
    bad = MALFORMED[kind]
    # interleave: bad, valid, bad, valid, ...
    requests, expect_ok = [], []
    for i in range(max(len(valid), len(bad))):
        if i < len(bad):
            requests.append(bad[i]); expect_ok.append(None)
        if i < len(valid):
            requests.append(valid[i]); expect_ok.append(valid[i])
    answers = serve_batch(h, ctx, requests)
    atol = 2e-2 if dtype == "float16" else 1e-4
    for (status, body), want in zip(answers, expect_ok):
        if want is None:
            assert 400 <= status < 500, body
            assert body["status"] == status and body["error"]
        else:
            assert status == 200, body
            close_enough(body, reference(kind, model, folder, *want), atol)
    # Batched answers equal one-by-one answers (padding/stacking does not leak between requests).
    for req, (_, batched) in zip(requests, answers):
        if req in valid:
            (status, alone), = serve_batch(h, ctx, [req])
            assert status == 200
            close_enough(alone, batched, 1e-5 if dtype == "float32" else 2e-2)
    h.close()
    assert h.runtime is None


def test_a_bare_json_string_body_is_read_once(tmp_path):
    """TorchServe json.loads an application/json body before the handler sees it: a bare JSON string is
    the text itself (it was read as JSON a second time: a 400, or an object when the text held JSON)."""
    folder, _ = make_variant(tmp_path, "text-embedding", "eager")
    h = load(TorchHandler, folder)
    text, holds_json = " ".join(WORDS[:4]), json.dumps({"text": "guitar"})
    answers = serve_batch(h, make_context(folder, {"threads": 1}),
                          [(json.dumps(text).encode(), "application/json"), (text.encode(), "text/plain"),
                           (json.dumps(holds_json).encode(), "application/json"), (holds_json.encode(), "text/plain"),
                           (b"5", "application/json")])
    (s1, bare), (s2, plain), (s3, bare_json), (s4, plain_json), (s5, number) = answers
    assert s1 == s2 == s3 == s4 == 200, answers
    close_enough(bare, plain, 1e-6)
    close_enough(bare_json, plain_json, 1e-6)
    assert s5 == 400 and "text" in number["error"]
    h.close()


def test_all_malformed_batch_and_unsupported_content_type(tmp_path):
    folder, _ = make_variant(tmp_path, "tensor", "torchscript")
    h = load(TorchHandler, folder)
    answers = serve_batch(h, make_context(folder, {}), [(b"[1,", "application/json"), (b"\x00\x01", "image/png")])
    assert [s for s, _ in answers] == [400, 415]
    assert "shape" in h.adapter.usage() or "JSON" in answers[0][1]["error"]


def test_size_limit_from_model_config(tmp_path):
    folder, _ = make_variant(tmp_path, "text-embedding", "torchscript")
    h = load(TorchHandler, folder, max_request_bytes=32)
    answers = serve_batch(h, make_context(folder, {}), [(b"hello world", "text/plain"),
                                                        (("hello " * 20).encode(), "text/plain")])
    assert answers[0][0] == 200 and answers[1][0] == 413
    assert "32" in answers[1][1]["error"]


def test_handler_refuses_wrong_family_and_missing_files(tmp_path):
    folder, _ = make_variant(tmp_path, "tensor", "onnx")
    with pytest.raises(HandlerSetupError, match="wrong handler"):
        TorchHandler().initialize(make_context(folder, {}))
    (folder / "model.onnx").unlink()
    with pytest.raises(HandlerSetupError, match="model.onnx"):
        OnnxHandler().initialize(make_context(folder, {}))


def test_variant_files_must_stay_inside_model_dir(tmp_path):
    folder, _ = make_variant(tmp_path, "tensor", "torchscript")
    v = json.loads((folder / "variant.json").read_text())
    v["files"].append("../outside.txt")
    (tmp_path / "outside.txt").write_text("x")
    (folder / "variant.json").write_text(json.dumps(v))
    with pytest.raises(HandlerSetupError, match="outside the model folder"):
        TorchHandler().initialize(make_context(folder, {}))


def test_settings_and_device_resolution():
    assert handler_settings({"handler": {"threads": 2, "device": "cpu", "warmup_batch_size": 8,
                                         "max_request_bytes": 1000}})["threads"] == 2
    assert handler_settings(None) == {"threads": None, "device": None, "warmup_batch_size": None,
                                      "max_request_bytes": None, "batch_rows": None}
    with pytest.raises(HandlerSetupError, match="native YAML integer"):
        handler_settings({"handler": {"threads": "2"}})
    with pytest.raises(HandlerSetupError, match="allowed cpu, cuda, auto"):
        handler_settings({"handler": {"device": "tpu"}})
    assert resolve_device("cpu", "cuda", 0) == ("cpu", None)
    assert resolve_device(None, "cuda", 1) == ("cuda", 1)
    assert resolve_device("auto", None, None) == ("cpu", None)
    assert resolve_device(None, None, 0) == ("cuda", 0)
    with pytest.raises(HandlerSetupError, match="no GPU"):
        resolve_device("cuda", "cpu", None)


def test_warmup_defaults_to_torchserve_batch_size_and_zero_disables(tmp_path):
    folder, _ = make_variant(tmp_path, "tensor", "torchscript")
    h = TorchHandler()
    h.initialize(make_context(folder, {"threads": 1}, batch_size=3))
    assert "warmup_bs3" in h.load_breakdown_ms
    h0 = TorchHandler()
    h0.initialize(make_context(folder, {"warmup_batch_size": 0}))
    assert "warmup_bs0" in h0.load_breakdown_ms


def test_model_failure_isolated_to_the_breaking_request(tmp_path):
    """If the batch fails inside the model, samples are retried alone: only the culprit errors."""
    folder, _ = make_variant(tmp_path, "tensor", "torchscript")
    h = load(TorchHandler, folder)
    real_run = h.runtime.run

    def run(feeds):   # a model that cannot take NaN-free inputs whose first value is exactly 7
        if (feeds["input"][:, 0, 0] == 7.0).any():
            raise RuntimeError("boom")
        return real_run(feeds)
    h.runtime.run = run
    good = VALID["tensor"](0)
    poison = (json.dumps([[7.0] * 4] * 3).encode(), "application/json")
    answers = serve_batch(h, make_context(folder, {}), [good, poison, good])
    assert [s for s, _ in answers] == [200, 500, 200]
    assert "boom" in answers[1][1]["error"]


def test_onnx_handler_never_imports_torch(tmp_path):
    folder, _ = make_variant(tmp_path, "text-embedding", "onnx")
    code = textwrap.dedent(f"""
        import json, sys
        import ts
        from ts.context import Context, RequestProcessor
        from handlers.onnx_handler import OnnxHandler
        ctx = Context("m", {str(folder)!r}, {{"model": {{}}}}, 2, None, ts.__version__,
                      model_yaml_config={{"handler": {{"threads": 1, "warmup_batch_size": 2}}}})
        h = OnnxHandler(); h.initialize(ctx)
        ctx.request_processor = [RequestProcessor({{"body": {{"content-type": "text/plain"}}}})]
        out = h.handle([{{"body": "hello world"}}], ctx)
        assert len(json.loads(out[0])["embedding"]) == 6, out
        print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))))
    """)
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == []


@pytest.mark.parametrize("module,cls", [("torch_handler", "TorchHandler"), ("onnx_handler", "OnnxHandler"),
                                        ("baseline_handler", "BaselineHandler")])
def test_each_handler_module_defines_exactly_one_class(module, cls):
    """TorchServe's loader (ts.utils.util.list_classes_from_module) needs exactly one own class."""
    import importlib
    from ts.utils.util import list_classes_from_module
    mod = importlib.import_module(f"handlers.{module}")
    assert [c.__name__ for c in list_classes_from_module(mod)] == [cls]
