"""Seeded requests in each task's client format, with what a reference needs to answer the same
request: the inputs of the served-vs-transformers check."""
from __future__ import annotations

import base64
import io
import json
import random
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

TASKS = ("text-classification", "token-classification", "rerank", "image-classification")
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
