"""Serve a model in a REAL TorchServe the way the pipeline does and compare every answer with
`transformers.pipeline(<task>)` on the same eager model (issue 26: "tried with models the tests never saw").

    python scripts/served_vs_transformers.py FOLDER --task text-classification [--requests 48]
    python scripts/served_vs_transformers.py --params examples/efficientnet-lite0/params.yaml

The folder's model goes through the pipeline's own steps (pipeline/serve/variant_server.py: prepare's
golden set, the `eager` variant built and verified, the .mar with its handler, config.properties) and
is served in TorchServe 0.12 (4 concurrent clients, batches of up to 4 requests, so answers come from
mixed batches), always stopped. N seeded requests in the task's client format:
- text-classification: text/plain, texts of 1 to ~150 words (over `--max-length` tokens: truncated,
  as the reference is told), pairs, lists, `top_k` (1, 2, all), `function_to_apply`;
- token-classification: aggregation none / simple / first / average / max, `ignore_labels`, lists,
  text/plain (the served default strategy), words split into pieces, accents, CJK, [UNK];
- rerank: TEI bodies with 10-50 texts per query, `top_n`, `return_text`, `raw_scores`;
- image-classification: PNG / JPEG / base64 JSON with `top_k` / `function_to_apply`, non-square images
  of several sizes (smaller and larger than the crop), grayscale, RGBA, an EXIF-rotated JPEG.
The reference for each: `transformers.pipeline(task)` on the folder (text-classification also with
`truncation=True, max_length` = the served cap; token-classification's text/plain with the served
default strategy), rerank: sigmoid of the eager cross-encoder's logits (only_second truncation at the
cap), highest first; a `state_dict` image model (transformers has no pipeline for it): its factory +
weights' own eager forward on transformers' BitImageProcessorPil set to params `model.image`, then
the task's score function. Labels, order, indices, entity words and offsets must be equal; scores
within 0.01 (`--atol`). Order swaps between items whose reference scores are within 1e-5 are ties,
counted, not failed. Prints a table per request kind and a JSON summary; exit 1 on any mismatch.
`--variant V` serves another variant instead of eager (fp16, bf16, onnx, ...: the winner the pipeline may
select), built and verified within its dtype's tolerances first (a rejected one stops the run, with the
reason), and still compared with the fp32 transformers reference.
`--in-process` runs the handler's task adapter on the eager model in this process instead of a
TorchServe (seconds; what the fast test uses). Results: docs/results/2026-12-tasks.md.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

TASKS = ("text-classification", "token-classification", "rerank", "image-classification")
ATOL = 0.01
TIE_EPS = 1e-5
STRATEGIES = ("none", "simple", "first", "average", "max")
# Words of several kinds: split by WordPiece into many pieces, capitals, punctuation, digits, accents,
# CJK (one token per character), an emoji ([UNK] in MiniLM's vocabulary).
WORDS = ("a man is playing guitar the market fell sharply today someone strums near river quiet morning "
         "children play in garden orchestra performs symphony tonight train leaves city at noon musicians "
         "rehearse old church evening by ocean student reads about music history dogs bark moon and of "
         "Johannesburg Antananarivo Zbigniew Kazakhstan's electrification hyperparameterisation unbelievably "
         "Strumming Rue Saint-Honoré café naïve Zürich São Paulo McDonald's O'Neill 2026 3.14 $42 e-mail "
         "U.S.A. well-known re-entry Tōkyō 東京 北京 🙂 Mr. Dr. Paris London Berlin Microsoft Apple IBM NASA "
         "!? , . ; : ( ) -").split()


# --------------------------------------------------------------------------- the cases
@dataclass
class Case:
    kind: str                       # the table's row: what this request exercises
    body: bytes
    content_type: str
    ref: dict                       # what the reference needs to answer the same request
    served: Any = None              # (status, answer)
    want: Any = None
    problems: list = field(default_factory=list)
    cause: str = ""
    ties: int = 0
    max_diff: float = 0.0


def _json(doc) -> bytes:
    return json.dumps(doc, ensure_ascii=False).encode("utf-8")


def sentence(rng: random.Random, lo: int, hi: int) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
    text = " ".join(words)
    return text[0].upper() + text[1:] if text[0].isalpha() else text


def text_classification_cases(n: int, rng: random.Random, _ctx: dict) -> list[Case]:
    out = []
    for k in range(n):
        kind = k % 8
        text = sentence(rng, 1, 40)
        if kind == 0:
            out.append(Case("text/plain", text.encode(), "text/plain", {"inputs": text, "kw": {}}))
        elif kind == 1:
            out.append(Case("top_k=null", _json({"inputs": text, "parameters": {"top_k": None}}), "application/json",
                            {"inputs": text, "kw": {"top_k": None}, "nested": True}))
        elif kind == 2:
            pair = {"text": text, "text_pair": sentence(rng, 1, 30)}
            out.append(Case("pair", _json({"inputs": pair}), "application/json", {"inputs": pair, "kw": {}}))
        elif kind == 3:
            pair = {"text": sentence(rng, 20, 90), "text_pair": sentence(rng, 20, 90)}
            params = {"top_k": 2, "function_to_apply": "sigmoid"}
            out.append(Case("pair top_k=2 sigmoid (long)", _json({"inputs": pair, "parameters": params}),
                            "application/json", {"inputs": pair, "kw": params}))
        elif kind == 4:
            items = [sentence(rng, 1, 25) if rng.random() < 0.6 else
                     {"text": sentence(rng, 1, 15), "text_pair": sentence(rng, 1, 15)}
                     for _ in range(rng.randint(2, 6))]
            params = {"function_to_apply": "none", "top_k": None}
            out.append(Case("list none top_k=null", _json({"inputs": items, "parameters": params}),
                            "application/json", {"inputs": items, "kw": params, "list": True}))
        elif kind == 5:
            params = {"top_k": 1, "function_to_apply": "softmax"}
            out.append(Case("top_k=1 softmax", _json({"inputs": text, "parameters": params}), "application/json",
                            {"inputs": text, "kw": params, "nested": True}))
        elif kind == 6:
            long = sentence(rng, 90, 160)
            out.append(Case("long (truncated) top_k=null", _json({"inputs": long, "parameters": {"top_k": None}}),
                            "application/json", {"inputs": long, "kw": {"top_k": None}, "nested": True}))
        else:
            out.append(Case("bare JSON string", _json(text), "application/json", {"inputs": text, "kw": {}}))
    return out


def token_classification_cases(n: int, rng: random.Random, ctx: dict) -> list[Case]:
    fits = ctx["fits"]                       # text -> within the served token limit

    def text_of(lo, hi):
        while True:
            t = sentence(rng, lo, hi)
            if fits(t):
                return t
            hi = max(lo, hi - 5)

    out = []
    for k in range(n):
        kind = k % 8
        text = text_of(3, 45)
        if kind < 5:
            s = STRATEGIES[kind]
            out.append(Case(f"aggregation {s}", _json({"inputs": text, "parameters": {"aggregation_strategy": s}}),
                            "application/json", {"inputs": text, "kw": {"aggregation_strategy": s}}))
        elif kind == 5:
            s = rng.choice(("none", "simple"))
            params = {"aggregation_strategy": s, "ignore_labels": []}
            out.append(Case(f"{s} ignore_labels=[]", _json({"inputs": text, "parameters": params}),
                            "application/json", {"inputs": text, "kw": params}))
        elif kind == 6:
            texts = [text_of(1, 20) for _ in range(rng.randint(2, 4))]
            s = rng.choice(STRATEGIES[1:])
            out.append(Case(f"list {s}", _json({"inputs": texts, "parameters": {"aggregation_strategy": s}}),
                            "application/json", {"inputs": texts, "kw": {"aggregation_strategy": s}, "list": True}))
        else:       # no parameters: the served default strategy; the text as text/plain or a bare JSON string
            plain = (k // 8) % 2 == 0
            out.append(Case("text/plain (default strategy)" if plain else "bare JSON string (default strategy)",
                            text.encode() if plain else _json(text), "text/plain" if plain else "application/json",
                            {"inputs": text, "kw": {"aggregation_strategy": ctx["default_strategy"]}}))
    return out


def rerank_cases(n: int, rng: random.Random, _ctx: dict) -> list[Case]:
    out = []
    for k in range(n):
        kind = k % 5
        query = sentence(rng, 3, 12)
        texts = [sentence(rng, 1, 120 if rng.random() < 0.15 else 30) for _ in range(rng.randint(10, 50))]
        doc: dict = {"query": query, "texts": texts}
        name = "plain"
        if kind == 1:
            doc["top_n"] = rng.randint(1, 8)
            name = "top_n"
        elif kind == 2:
            doc["return_text"] = True
            name = "return_text"
        elif kind == 3:
            doc["raw_scores"] = True
            name = "raw_scores"
        elif kind == 4:
            doc = {"query": query, "documents": texts, "top_n": 5, "return_text": True}
            name = "documents top_n return_text"
        out.append(Case(name, _json(doc), "application/json", {"query": query, "texts": texts, "doc": doc}))
    return out


IMAGE_SIZES = ((320, 240), (240, 320), (500, 200), (97, 131), (640, 480), (150, 400), (33, 57), (224, 300))


def picture(rng: random.Random, width: int, height: int):
    """Smooth backgrounds and shapes: class scores then have clear winners (noise gives near ties)."""
    from PIL import Image, ImageDraw
    c0, c1 = ([rng.randint(0, 255) for _ in range(3)] for _ in range(2))
    ramp = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :, None]
    bg = np.asarray(c0, np.float32) * (1 - ramp) + np.asarray(c1, np.float32) * ramp
    img = Image.fromarray(np.repeat(bg, height, axis=0).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(rng.randint(1, 5)):
        x0, y0 = rng.randint(0, width // 2), rng.randint(0, height // 2)
        box = (x0, y0, x0 + rng.randint(4, max(5, width // 2)), y0 + rng.randint(4, max(5, height // 2)))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=tuple(rng.randint(0, 255) for _ in range(3)))
    return img


def _file(img, fmt: str, **save) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **save)
    return buf.getvalue()


def image_classification_cases(n: int, rng: random.Random, ctx: dict) -> list[Case]:
    from PIL import Image
    num_classes = ctx["num_classes"]
    out = []
    for k in range(n):
        kind = k % 8
        width, height = IMAGE_SIZES[(k + k // 8) % len(IMAGE_SIZES)]
        img = picture(rng, width, height)
        if kind == 0:
            out.append(Case("PNG", _file(img, "PNG"), "image/png", {"kw": {}}))
        elif kind == 1:
            out.append(Case("JPEG", _file(img, "JPEG", quality=90), "image/jpeg", {"kw": {}}))
        elif kind == 2:
            params = {"top_k": min(2, num_classes)}
            body = _json({"inputs": base64.b64encode(_file(img, "PNG")).decode(), "parameters": params})
            out.append(Case("base64 top_k=2", body, "application/json", {"kw": params}))
        elif kind == 3:
            params = {"top_k": num_classes, "function_to_apply": "sigmoid"}
            body = _json({"inputs": base64.b64encode(_file(img, "JPEG")).decode(), "parameters": params})
            out.append(Case("base64 top_k=all sigmoid", body, "application/json", {"kw": params}))
        elif kind == 4:
            params = {"function_to_apply": "none", "top_k": 3}
            body = _json({"inputs": "data:image/png;base64," + base64.b64encode(_file(img, "PNG")).decode(),
                          "parameters": params})
            out.append(Case("data URI none top_k=3", body, "application/json", {"kw": params}))
        elif kind == 5:
            out.append(Case("grayscale PNG", _file(img.convert("L"), "PNG"), "image/png", {"kw": {}}))
        elif kind == 6:
            rgba = img.convert("RGBA")
            rgba.putalpha(Image.fromarray(np.tile(np.linspace(0, 255, width, dtype=np.uint8), (height, 1))))
            out.append(Case("RGBA PNG", _file(rgba, "PNG"), "image/png", {"kw": {}}))
        else:
            exif = Image.Exif()
            exif[0x0112] = rng.choice((3, 6, 8))          # Orientation: rotated 180 / 90 / 270
            out.append(Case("JPEG EXIF-rotated", _file(img, "JPEG", quality=90, exif=exif), "image/jpeg", {"kw": {}}))
    return out


CASES: dict[str, Callable[[int, random.Random, dict], list[Case]]] = {
    "text-classification": text_classification_cases, "token-classification": token_classification_cases,
    "rerank": rerank_cases, "image-classification": image_classification_cases}


# --------------------------------------------------------------------------- the references
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


# --------------------------------------------------------------------------- the comparison
def same_answers(got, want, atol: float = ATOL) -> list[str]:
    """Differences between two answers: every key exact except `score` (within atol)."""
    problems = []
    if isinstance(want, dict):
        want = [want]
    if not isinstance(got, list):
        return [f"a {type(got).__name__} served vs a list of {len(want)} expected: {str(got)[:200]}"]
    if len(got) != len(want):
        k = next((i for i, (g, w) in enumerate(zip(got, want)) if not _same_item(g, w)), min(len(got), len(want)))
        return [f"{len(got)} items served vs {len(want)} expected; the first difference at item {k}: served "
                f"{_short(got[k:k + 1])} vs expected {_short(want[k:k + 1])}"]
    for k, (g, w) in enumerate(zip(got, want)):
        if isinstance(w, list):
            problems += same_answers(g, w, atol)
            continue
        if not isinstance(g, dict):
            problems.append(f"item {k}: {g!r} vs {w!r}")
            continue
        w = {key: (float(v) if key == "score" else v) for key, v in w.items()}
        if set(g) != set(w):
            problems.append(f"item {k}: keys {sorted(g)} vs {sorted(w)}")
        for key in w:
            if key == "score":
                if not isinstance(g.get(key), (int, float)) or abs(g[key] - w[key]) > atol:
                    problems.append(f"item {k}: score {g.get(key)} vs {w[key]}")
            elif g.get(key) != w[key]:
                problems.append(f"item {k}: {key} {g.get(key)!r} vs {w[key]!r}")
    return problems


def _short(items) -> str:
    return json.dumps(items, default=float)[:200]


def _same_item(g, w) -> bool:
    """Every key but the score equal (the same label / index / entity and span)."""
    if not (isinstance(g, dict) and isinstance(w, dict)):
        return g == w
    return {k: v for k, v in g.items() if k != "score"} == {k: v for k, v in w.items() if k != "score"}


def max_score_diff(got, want) -> float:
    """The largest score difference over the items that agree in everything else (position by position)."""
    if isinstance(want, dict):
        want = [want]
    if not isinstance(got, list):
        return 0.0
    diffs = [0.0]
    for g, w in zip(got, want):
        if isinstance(w, list):
            diffs.append(max_score_diff(g, w))
        elif _same_item(g, w) and isinstance(g.get("score"), (int, float)):
            diffs.append(abs(float(g["score"]) - float(w["score"])))
    return max(diffs)


def _identity(item: dict):
    return item.get("label", item.get("index"))


def untie(got, want, eps: float = TIE_EPS) -> tuple[Any, int]:
    """`got` with items reordered inside runs of the reference whose scores are within `eps` of each
    other (ranked lists: label / index answers), and how many runs it had to reorder."""
    if isinstance(want, dict) or not isinstance(got, list) or not want or len(got) != len(want):
        return got, 0
    if isinstance(want[0], list):
        pairs = [untie(g, w, eps) for g, w in zip(got, want)]
        return [p[0] for p in pairs], sum(p[1] for p in pairs)
    if not all(isinstance(g, dict) for g in got) or _identity(want[0]) is None or "entity" in want[0]:
        return got, 0
    out, ties, start = list(got), 0, 0
    while start < len(want):
        end = start + 1
        while end < len(want) and abs(float(want[end]["score"]) - float(want[start]["score"])) <= eps:
            end += 1
        run = {_identity(w): i for i, w in enumerate(want[start:end])}
        block = got[start:end]
        if end - start > 1 and [_identity(g) for g in block] != list(run) and \
                sorted(map(str, run)) == sorted(str(_identity(g)) for g in block):
            out[start:end] = sorted(block, key=lambda g: run[_identity(g)])
            ties += 1
        start = end
    return out, ties


def judge(case: Case, atol: float = ATOL) -> Case:
    status, answer = case.served
    if status != 200:
        case.problems = [f"HTTP {status}: {answer}"]
        return case
    untied, case.ties = untie(answer, case.want)
    case.problems = same_answers(untied, case.want, atol)
    case.max_diff = max_score_diff(untied, case.want)
    if case.problems:
        case.cause = cause_of(answer, case.want, case.problems, atol, case.ref.get("scores"))
    return case


def near_tie_order(answer, want, atol: float, scores: Optional[dict] = None) -> bool:
    """A ranked answer whose every item sits where the reference has an item scored within `atol` of it
    (by the item's own reference score: `scores` holds those of items the reference cut off by top_n /
    top_k), every score within atol of its reference: the order moved only among near ties."""
    if isinstance(want, dict) or not isinstance(answer, list) or len(answer) != len(want):
        return False
    if want and isinstance(want[0], list):
        return all(near_tie_order(g, w, atol) for g, w in zip(answer, want))
    if not want or not all(isinstance(x, dict) for x in answer) or _identity(want[0]) is None or "entity" in want[0]:
        return False
    ref = {**(scores or {}), **{_identity(w): float(w["score"]) for w in want}}
    for g, w in zip(answer, want):
        own = ref.get(_identity(g))
        if own is None or abs(own - float(w["score"])) > atol or abs(float(g["score"]) - own) > atol:
            return False
    return True


def cause_of(answer, want, problems: list[str], atol: float, scores: Optional[dict] = None) -> str:
    """What a mismatch is, in a few words: scores only, an order among near ties, or a decision."""
    if all(p.partition(": ")[2].startswith("score ") for p in problems):
        return f"score off by more than {atol}"
    if near_tie_order(answer, want, atol, scores):
        return f"order of items whose reference scores are within {atol}"
    flat = want[0] if isinstance(want, list) and want and isinstance(want[0], list) else want
    if isinstance(flat, list) and flat and isinstance(flat[0], dict) and {"entity", "entity_group"} & set(flat[0]):
        return "entities differ (label or span)"
    return "labels / order differ"


def summarize(cases: list[Case]) -> dict:
    kinds: dict[str, dict] = {}
    for c in cases:
        row = kinds.setdefault(c.kind, {"requests": 0, "matched": 0, "ties": 0, "max_score_diff": 0.0})
        row["requests"] += 1
        row["matched"] += not c.problems
        row["ties"] += c.ties
        row["max_score_diff"] = max(row["max_score_diff"], c.max_diff)
    mismatches = [{"kind": c.kind, "body": c.body[:300].decode("utf-8", "replace") if c.content_type != "image/png"
                   and c.content_type != "image/jpeg" else f"<{c.content_type} {len(c.body)} bytes>",
                   "cause": c.cause, "problems": [p[:400] for p in c.problems[:5]]} for c in cases if c.problems]
    causes: dict[str, int] = {}
    for c in cases:
        if c.problems:
            causes[c.cause] = causes.get(c.cause, 0) + 1
    examples = {}
    for c in cases:
        if c.kind not in examples and c.served and c.served[0] == 200:
            examples[c.kind] = c.served[1][:3] if isinstance(c.served[1], list) else c.served[1]
    return {"requests": len(cases), "matched": sum(not c.problems for c in cases), "ties": sum(c.ties for c in cases),
            "max_score_diff": max((c.max_diff for c in cases), default=0.0),
            "distinct_first_answers": len({json.dumps(_first(c.want), sort_keys=True, default=str) for c in cases}),
            **agreement(cases), "causes": causes, "by_kind": kinds, "mismatches": mismatches, "examples": examples}


def _flat(answer) -> list:
    if isinstance(answer, dict):
        return [answer]
    if isinstance(answer, list) and answer and isinstance(answer[0], list):
        return [x for a in answer for x in _flat(a)]
    return answer if isinstance(answer, list) else []


def agreement(cases: list[Case]) -> dict:
    """Task figures beside exactness: entity-level F1 (exact type and span) for token-classification,
    first-answer agreement for ranked answers (a list input: its first text's)."""
    judged = [c for c in cases if c.served and c.served[0] == 200]
    items = [x for c in judged for x in _flat(c.want)]
    if items and ("entity" in items[0] or "entity_group" in items[0]):
        def spans(answer, key):
            texts = answer if isinstance(answer, list) and answer and isinstance(answer[0], list) else [answer]
            return {(key, t, x.get("entity_group", x.get("entity")), x["start"], x["end"])
                    for t, entities in enumerate(texts) for x in _flat(entities)}
        served = set().union(*(spans(c.served[1], k) for k, c in enumerate(judged)))
        wanted = set().union(*(spans(c.want, k) for k, c in enumerate(judged)))
        hit = len(served & wanted)
        f1 = 2 * hit / (len(served) + len(wanted)) if served or wanted else 1.0
        return {"entity_f1": round(f1, 4)}
    same = [json.dumps(_first(untie(c.served[1], c.want)[0]), sort_keys=True, default=str) ==
            json.dumps(_first(c.want), sort_keys=True, default=str) for c in judged]
    return {"first_answer_agreement": round(sum(same) / len(same), 4) if same else None}


def _first(answer):
    """The top item's identity (label / index / entity and span): how varied the answers are."""
    while isinstance(answer, list) and answer:
        answer = answer[0]
    if not isinstance(answer, dict):
        return None
    return {k: v for k, v in answer.items() if k in ("label", "index", "entity", "entity_group", "start", "end")}


def table(summary: dict) -> str:
    w = max([12, *map(len, summary["by_kind"])])
    lines = [f"| {'request kind':<{w}} | requests | matched | ties | max abs(score diff) |",
             f"|{'-' * (w + 2)}|---------:|--------:|-----:|--------------------:|"]
    for kind, r in summary["by_kind"].items():
        lines.append(f"| {kind:<{w}} | {r['requests']:>8} | {r['matched']:>7} | {r['ties']:>4} | "
                     f"{r['max_score_diff']:>19.2e} |")
    lines.append(f"| {'all':<{w}} | {summary['requests']:>8} | {summary['matched']:>7} | {summary['ties']:>4} | "
                 f"{summary['max_score_diff']:>19.2e} |")
    lines += [f"mismatches: {n} x {cause}" for cause, n in summary["causes"].items()]
    return "\n".join(lines)


# --------------------------------------------------------------------------- the run
def params_for(args) -> Any:
    import yaml

    from pipeline.core.params import parse_params
    if args.params:
        data = yaml.safe_load(Path(args.params).read_text())
        data["model"]["name"] = "cc-" + str(data["model"].get("name", "model"))
    else:
        data = {"model": {"name": f"cc-{args.task}", "source": "hf", "checkpoint": str(Path(args.folder).resolve()),
                          "task": args.task}}
        if args.task != "image-classification":
            data["model"]["text"] = {"max_length": args.max_length}
    data["variants"] = list(dict.fromkeys(["eager", args.variant]))
    data["benchmark"] = {**(data.get("benchmark") or {}), "batch_sizes": [1, 4]}
    data["conversion"] = {**(data.get("conversion") or {}), "golden_batches": 1}
    return parse_params(data)


def context_for(task: str, params, task_map: dict, folder: Optional[Path]) -> dict:
    ctx: dict = {}
    if task == "token-classification":
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tok.no_truncation()
        tok.no_padding()
        ctx["fits"] = lambda t: len(tok.encode(t).ids) <= params.model.text.max_length
        ctx["default_strategy"] = task_map.get("aggregation_strategy", "simple")
    if task == "image-classification":
        ctx["num_classes"] = int(task_map["num_classes"])
    return ctx


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


def post_concurrently(post: Callable[[bytes, str], tuple], cases: list[Case], clients: int) -> None:
    with ThreadPoolExecutor(clients) as pool:
        for case, served in zip(cases, pool.map(lambda c: post(c.body, c.content_type), cases)):
            case.served = served


def in_process_post(loaded, folder: Optional[Path], rows_per_call: int = 4) -> Callable[[bytes, str], tuple]:
    """The serving handler's steps on the eager module, in this process: decode, fan rows out in calls of
    `rows_per_call`, gather, respond (a 4xx as TorchServe's handler answers it)."""
    import torch

    from handlers.tasks import RequestError, make_adapter
    adapter = make_adapter(folder if folder is not None else Path("."), loaded.task)

    def post(body: bytes, content_type: str):
        try:
            decoded = adapter.decode_request(body, content_type)
        except RequestError as e:
            return e.status, {"error": str(e)}
        outs = []
        for s in range(0, len(decoded.rows), rows_per_call):
            feeds = adapter.collate(decoded.rows[s:s + rows_per_call])
            with torch.no_grad():
                result = loaded.module(*loaded.example_inputs(feeds))
            logits = (result[0] if isinstance(result, (tuple, list)) else result).numpy()
            outs += [[logits[j]] for j in range(logits.shape[0])]
        return 200, json.loads(json.dumps(adapter.respond_request(outs, decoded.meta)))
    return post


def compare(task: str, cases: list[Case], reference, atol: float = ATOL) -> dict:
    for case in cases:
        case.want = reference(case)
        judge(case, atol)
    return summarize(cases)


def _commit() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=REPO_ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(args) -> dict:
    """Build, serve, ask, compare; the workdir (artifacts, the server's logs) is removed unless --workdir."""
    root = Path(args.workdir or tempfile.mkdtemp(prefix="served-vs-transformers-"))
    try:
        return _run(args, root)
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)


def _run(args, root: Path) -> dict:
    params = params_for(args)
    task = params.model.task
    if task not in TASKS:
        raise SystemExit(f"task {task!r}: this check covers {', '.join(TASKS)}")
    folder = Path(args.folder).resolve() if args.folder else None
    if folder is None and params.model.source == "hf":
        from pipeline.core.params import checkpoint_path
        folder = checkpoint_path(params)
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    batches: dict[str, int] = {}
    if args.in_process:
        from pipeline.model.checkpoint import load_model
        loaded = load_model(params)
        task_map, ts = loaded.task, None
        post = in_process_post(loaded, folder)
    else:
        from pipeline.serve.variant_server import serve_variant
        served = serve_variant(params, root, variant=args.variant)
        task_map, ts = served.golden.task, served.ts
    timings["build_s"] = time.monotonic() - t0
    cases = CASES[task](args.requests, random.Random(args.seed), context_for(task, params, task_map, folder))
    t1 = time.monotonic()
    if ts is None:
        post_concurrently(post, cases, args.clients)
    else:
        with ts:
            ids: list = []

            def post(body, ct):
                r = ts.api.predict(body, ct)
                ids.append(r.request_id)
                try:
                    return r.status, r.json()
                except ValueError:
                    return r.status, r.body[:300].decode("utf-8", "replace")
            post_concurrently(post, cases, args.clients)
            timings["ready_s"] = ts.readiness.ready_s if ts.readiness else None
            batches = {str(k): v for k, v in sorted(ts.log.batch_sizes_for(ids).items())}
    timings["serve_s"] = time.monotonic() - t1
    t2 = time.monotonic()
    reference = reference_for(task, params, task_map, folder)
    summary = compare(task, cases, reference, args.atol)
    timings["reference_s"] = time.monotonic() - t2
    described = REFERENCE_NAMES[type(reference).__name__].format(task=task)
    return {"task": task, "model": str(folder or params.model.checkpoint), "variant": args.variant,
            "served": "in-process adapter" if args.in_process else "TorchServe 0.12 (4 clients, batch 4)",
            "reference": described, "seed": args.seed, "atol": args.atol, "commit": _commit(),
            "date": time.strftime("%Y-%m-%d"), **summary, "batches_formed": batches, "timings_s": timings}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", nargs="?",
                    help="an HF folder (config.json, weights, tokenizer.json / preprocessor_config.json)")
    ap.add_argument("--task", choices=TASKS, help="the folder's task (with --params: the params file's)")
    ap.add_argument("--params", help="a params file instead of a folder (e.g. a state_dict + factory image model)")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-length", type=int, default=128, help="model.text.max_length served (tokens)")
    ap.add_argument("--variant", default="eager", help="the variant served (default eager, the exact reference)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--atol", type=float, default=ATOL)
    ap.add_argument("--workdir", help="where artifacts and the server's logs go (default a new temp dir)")
    ap.add_argument("--json-out", type=Path, help="also write the JSON summary here")
    ap.add_argument("--in-process", action="store_true", help="the handler's adapter in this process, no TorchServe")
    args = ap.parse_args(argv)
    if bool(args.folder) == bool(args.params):
        ap.error("give a FOLDER (with --task) or --params FILE")
    if args.folder and not args.task:
        ap.error("FOLDER needs --task")
    if args.in_process and args.variant != "eager":
        ap.error("--in-process runs the eager model; --variant needs a TorchServe")
    result = run(args)
    print(table(result))
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(text + "\n")
    return 1 if result["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
