"""The answers each request is compared with: transformers' own pipelines, the eager cross-encoder
for rerank, a state_dict image model's own eager forward on transformers' image processor."""
from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Optional

import numpy as np

from scripts.served_compare.cases import Case


def _quiet_transformers():
    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def pipeline_of(task: str, folder: Path):
    """transformers' own pipeline on the folder (rerank: the text-classification one over its logit)."""
    transformers = _quiet_transformers()
    name = "text-classification" if task == "rerank" else task
    if task == "image-classification":
        processor = transformers.AutoImageProcessor.from_pretrained(str(folder))   # the PIL one without torchvision
        return transformers.pipeline(name, model=str(folder), image_processor=processor, device="cpu")
    return transformers.pipeline(name, model=str(folder), tokenizer=str(folder), device="cpu")


def eager_rerank(folder: Path, query: str, texts: list[str], max_length: Optional[int] = None, *,
                 raw_scores: bool = False, model=None, tokenizer=None) -> list[dict]:
    """Sigmoid of the eager cross-encoder's logits (the raw logits with raw_scores), highest first
    (ties: request order); the document side truncated to `max_length` tokens (only_second)."""
    import torch
    transformers = _quiet_transformers()
    tok = tokenizer or transformers.AutoTokenizer.from_pretrained(str(folder))
    model = model or transformers.AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    kw = {"max_length": max_length} if max_length else {}
    with torch.no_grad():
        batch = tok([query] * len(texts), texts, return_tensors="pt", padding=True, truncation="only_second", **kw)
        logits = model(**batch).logits[:, 0].numpy().astype(np.float64)
    scores = logits if raw_scores else 1.0 / (1.0 + np.exp(-logits))
    return [{"index": int(i), "score": float(scores[i])} for i in np.argsort(-scores, kind="stable")]


def _as_list(answer):
    return [answer] if isinstance(answer, dict) else answer


class TextReference:
    """text-classification / token-classification: the pipeline per input (a list: one answer per item)."""

    def __init__(self, task: str, folder: Path, max_length: int):
        self.task, self.pipe, self.max_length = task, pipeline_of(task, folder), max_length

    def __call__(self, case: Case):
        kw = dict(case.ref["kw"])
        if self.task == "text-classification":
            kw |= {"truncation": True, "max_length": self.max_length}      # the served cap (tokens)
        items = case.ref["inputs"] if case.ref.get("list") else [case.ref["inputs"]]
        answers = [_as_list(self.pipe(item, **kw)) for item in items]
        if case.ref.get("nested"):      # {"inputs": "<text>"}: one list per input (the HF Inference API's shape)
            return answers
        return answers if case.ref.get("list") else answers[0]


class RerankReference:
    def __init__(self, folder: Path, max_length: int):
        transformers = _quiet_transformers()
        self.folder, self.max_length = folder, max_length
        self.tok = transformers.AutoTokenizer.from_pretrained(str(folder))
        self.model = transformers.AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()

    def __call__(self, case: Case):
        doc = case.ref["doc"]
        ranked = eager_rerank(self.folder, case.ref["query"], case.ref["texts"], self.max_length,
                              raw_scores=bool(doc.get("raw_scores")), model=self.model, tokenizer=self.tok)
        case.ref["scores"] = {r["index"]: r["score"] for r in ranked}      # the cut-off ones' too
        if doc.get("top_n"):
            ranked = ranked[:doc["top_n"]]
        if doc.get("return_text"):
            ranked = [r | {"text": case.ref["texts"][r["index"]]} for r in ranked]
        return ranked


def _open(body: bytes, content_type: str):
    from PIL import Image
    if content_type == "application/json":
        data = json.loads(body)["inputs"]
        body = base64.b64decode(data.partition(",")[2] if data.startswith("data:") else data)
    return Image.open(io.BytesIO(body))


class ImagePipelineReference:
    """An HF folder with preprocessor_config.json: transformers' image-classification pipeline."""

    def __init__(self, folder: Path):
        self.pipe = pipeline_of("image-classification", folder)

    def __call__(self, case: Case):
        return self.pipe(_open(case.body, case.content_type), **case.ref["kw"])


class ImageEagerReference:
    """A state_dict + factory image model (no transformers pipeline exists for it): the factory's module
    with the weights, on pixels from transformers' BitImageProcessorPil set to params `model.image`
    (transformers' load_image first: EXIF orientation, RGB), then the score function, top_k, labels."""

    def __init__(self, params):
        import importlib.util

        import torch
        transformers = _quiet_transformers()
        from pipeline.core.params import checkpoint_path, resolve_path
        m, img = params.model, params.model.image
        spec, _, attr = m.factory.rpartition(":")
        if spec.endswith(".py"):
            loader = importlib.util.spec_from_file_location("_served_vs_factory", resolve_path(spec))
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(spec)
        self.model = getattr(module, attr)(**dict(m.factory_kwargs)).eval()
        path = checkpoint_path(params)
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            state = load_file(str(path))
        else:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
        self.model.load_state_dict(state, strict=True)

        def pair(v):
            return {"height": v, "width": v} if isinstance(v, int) else {"height": v[0], "width": v[1]}
        def three(v, default):
            return [float(x) for x in v] if isinstance(v, list) else [float(default if v is None else v)] * 3
        resample = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4,
                    "hamming": 5}[img.resample or "bilinear"]
        kw = {"do_resize": True, "resample": resample, "do_rescale": img.rescale_factor is not None,
              "rescale_factor": img.rescale_factor or 1.0, "do_normalize": True,
              "image_mean": three(img.mean, 127.0), "image_std": three(img.std, 128.0), "do_convert_rgb": True}
        if img.resize_shortest_edge:
            kw |= {"size": {"shortest_edge": img.resize_shortest_edge}, "do_center_crop": True,
                   "crop_size": pair(img.crop_size)}
        else:
            kw |= {"size": pair(img.size or 224), "do_center_crop": img.crop_size is not None}
            if img.crop_size is not None:
                kw["crop_size"] = pair(img.crop_size)
        self.processor = transformers.BitImageProcessorPil(**kw)
        self.load_image = transformers.image_utils.load_image
        # What the request does not say, params say, else transformers' rule (several classes: softmax).
        self.top_k, self.function = img.top_k, img.function_to_apply
        self.labels = json.loads(resolve_path(img.labels).read_text()) if img.labels else None
        self.torch = torch

    def __call__(self, case: Case):
        image = self.load_image(_open(case.body, case.content_type))
        pixels = self.processor(images=image, return_tensors="pt")["pixel_values"]
        with self.torch.no_grad():
            logits = self.model(pixels)[0].double().numpy()
        function = case.ref["kw"].get("function_to_apply") or self.function or \
            ("softmax" if logits.shape[0] > 1 else "sigmoid")
        scores = {"softmax": lambda x: np.exp(x - x.max()) / np.exp(x - x.max()).sum(),
                  "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)), "none": lambda x: x}[function](logits)
        top_k = min(case.ref["kw"].get("top_k") or self.top_k, len(scores))
        return [{"label": str(self.labels[i]) if self.labels else f"LABEL_{i}", "score": float(scores[i])}
                for i in np.argsort(-scores, kind="stable")[:top_k]]


REFERENCE_NAMES = {
    "TextReference": "transformers.pipeline('{task}')", "ImagePipelineReference": "transformers.pipeline('{task}')",
    "RerankReference": "sigmoid of the eager cross-encoder's logits (transformers' AutoModelForSequenceClassification)",
    "ImageEagerReference": "the factory module's eager forward + the score function (transformers has no pipeline "
                           "for it), on transformers' BitImageProcessorPil set to params model.image"}


def reference_for(task: str, params, task_map: dict, folder: Optional[Path]):
    if task == "rerank":
        return RerankReference(folder, params.model.text.max_length)
    if task != "image-classification":
        return TextReference(task, folder, params.model.text.max_length)
    if folder is not None and (folder / "preprocessor_config.json").is_file():
        return ImagePipelineReference(folder)
    return ImageEagerReference(params)
