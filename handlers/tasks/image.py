"""image-classification: an image in, `[{"label", "score"}]` out, as `transformers.pipeline("image-classification")`.

Requests: the image file's bytes as the body (PNG, JPEG, ... ; Content-Type image/* or none), or JSON
`{"inputs": "<the image file, base64>" (a data: URI too), "parameters": {"top_k", "function_to_apply"}}`.
Answers: `[{"label", "score"}, ...]` sorted by score, `top_k` entries (default params `model.image.top_k`,
5, at most the number of labels). The score function is chosen as transformers does: regression →
none, multi-label or one label → sigmoid, else softmax.

Preprocessing follows an explicit recipe in the task mapping (`preprocess`), written at prepare time
from an HF folder's preprocessor_config.json or from params `model.image` (pipeline/model/families/image_classification.py)
and applied here with PIL + numpy only, step for step as transformers' PIL image processors do:
- the image is opened, turned upright by its EXIF orientation and converted to RGB (`load_image`);
- resize (PIL, the recipe's `resample` filter): `{"height", "width"}` exactly, or `{"shortest_edge"}`
  keeping the aspect ratio (the longer side `int(edge * long / short)`);
- centre crop `{"height", "width"}` (offsets floor((side - crop) / 2); an image smaller than the crop
  is padded with zeros around it);
- rescale: `pixels (float64) * rescale_factor` → float32; normalize: `(x - mean) / std` per RGB channel.
An image of more than `max_pixels` pixels is refused (413) before it is decoded (decompression bombs).
"""
from __future__ import annotations

import base64
import binascii
import io
import json
import random
import warnings
from typing import Any, Optional

import numpy as np

from handlers.tasks.classification import FUNCTIONS, default_function, scores_of
from handlers.tasks.text import parameters_of, positive_int
from handlers.tasks import (JSON_TYPES, Decoded, RequestError, TaskAdapter, _media_type, _parse_json,
                            check_keys)

# PIL's filter codes (PIL.Image.Resampling), the numbers preprocessor_config.json's `resample` holds.
RESAMPLE = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}
PARAMETERS = ("top_k", "function_to_apply")
MAX_PIXELS = 50_000_000


# --------------------------------------------------------------------------- the recipe
def legacy_recipe(task: dict) -> dict:
    """The recipe of a task mapping written before recipes: a square resize and one mean/std."""
    size = int(task.get("size", 224))
    return {"resize": {"height": size, "width": size}, "resample": "bilinear", "crop": None,
            "rescale_factor": None, "mean": [float(task.get("mean", 127.0))] * 3,
            "std": [float(task.get("std", 128.0))] * 3}


def check_recipe(recipe: dict) -> tuple[int, int]:
    """The model input's (height, width) the recipe makes; ValueError naming what is wrong."""
    resize, crop = recipe.get("resize"), recipe.get("crop")
    if recipe.get("resample", "bilinear") not in RESAMPLE:
        raise ValueError(f"preprocess.resample = {recipe.get('resample')!r}: allowed {', '.join(RESAMPLE)}")
    for key in ("mean", "std"):
        value = recipe.get(key)
        if value is not None and (not isinstance(value, list) or len(value) != 3):
            raise ValueError(f"preprocess.{key} = {value!r}: needs 3 numbers (R, G, B)")
    if (recipe.get("mean") is None) != (recipe.get("std") is None):
        raise ValueError("preprocess: mean and std go together")
    if resize is not None and set(resize) not in ({"height", "width"}, {"shortest_edge"}):
        raise ValueError(f"preprocess.resize = {resize!r}: needs height + width, or shortest_edge")
    if crop is not None:
        return int(crop["height"]), int(crop["width"])
    if resize is not None and "height" in resize:
        return int(resize["height"]), int(resize["width"])
    raise ValueError("preprocess: without a crop or an exact resize the input size varies per image; "
                     "the model takes one fixed size")


def resized_size(height: int, width: int, resize: dict) -> tuple[int, int]:
    """(height, width) after the resize: transformers' get_resize_output_image_size for shortest_edge."""
    if "shortest_edge" not in resize:
        return int(resize["height"]), int(resize["width"])
    edge = int(resize["shortest_edge"])
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(edge * long / short)
    return (new_long, edge) if width <= height else (edge, new_long)


def center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """HWC centre crop as transformers' image_transforms.center_crop, zero padding included."""
    h, w = pixels.shape[:2]
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0 and top + height <= h and left + width <= w:
        return pixels[top:top + height, left:left + width]
    new_h, new_w = max(height, h), max(width, w)
    padded = np.zeros((new_h, new_w) + pixels.shape[2:], dtype=pixels.dtype)
    top_pad, left_pad = -(-(new_h - h) // 2), -(-(new_w - w) // 2)      # ceil, as transformers
    padded[top_pad:top_pad + h, left_pad:left_pad + w] = pixels
    top, left = top + top_pad, left + left_pad
    return padded[max(0, top):min(new_h, top + height), max(0, left):min(new_w, left + width)]


def normalize(pixels: np.ndarray, recipe: dict) -> np.ndarray:
    """HWC uint8 → CHW float32: rescale (in float64, as transformers), then (x - mean) / std."""
    factor = recipe.get("rescale_factor")
    x = (pixels.astype(np.float64) * factor).astype(np.float32) if factor is not None else pixels.astype(np.float32)
    if recipe.get("mean") is not None:
        x = (x - np.asarray(recipe["mean"], dtype=np.float32)) / np.asarray(recipe["std"], dtype=np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))


def apply_recipe(rgb, recipe: dict) -> np.ndarray:
    """A PIL RGB image → the model's CHW float32 input."""
    resize = recipe.get("resize")
    if resize is not None:
        height, width = resized_size(rgb.height, rgb.width, resize)
        rgb = rgb.resize((width, height), resample=RESAMPLE[recipe.get("resample", "bilinear")])
    pixels = np.asarray(rgb)
    crop = recipe.get("crop")
    if crop is not None:
        pixels = center_crop(pixels, int(crop["height"]), int(crop["width"]))
    return normalize(pixels, recipe)


def open_rgb(data: bytes, max_pixels: int, usage: str):
    """The image file's bytes → an upright RGB PIL image (transformers' load_image); 4xx when it is not one."""
    from PIL import Image, ImageOps, UnidentifiedImageError
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)     # refused below, by our own cap
            img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise RequestError(413, f"the image declares more than {2 * (Image.MAX_IMAGE_PIXELS or 0)} pixels "
                                f"(a decompression bomb?); send an image of at most {max_pixels} pixels") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as e:
        raise RequestError(400, f"request body is not a decodable image ({type(e).__name__}); {usage}") from None
    with img:
        width, height = img.size
        if width * height > max_pixels:
            raise RequestError(413, f"the image is {width}x{height} = {width * height} pixels, over the limit of "
                                    f"{max_pixels} (model.image.max_pixels); downscale it before sending")
        try:
            return ImageOps.exif_transpose(img).convert("RGB")
        except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as e:
            raise RequestError(400, f"the image cannot be decoded ({type(e).__name__}: {str(e)[:80]}); "
                                    f"send a complete, valid image file") from None


def image_bytes_of(value: Any, usage: str) -> bytes:
    """JSON `inputs`: the image file base64-encoded, optionally as a data: URI."""
    if not isinstance(value, str):
        raise RequestError(400, f"`inputs` must be the image file base64-encoded (a string), got "
                                f"{type(value).__name__}; {usage}")
    text = value.strip()
    if text.startswith("data:"):
        text = text.partition(",")[2]
    text = "".join(text.split())
    if not text:
        raise RequestError(400, f"`inputs` is empty; {usage}")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(400, f"`inputs` is not valid base64; send the image file's bytes base64-encoded, "
                                f"or send the file itself as the body (Content-Type image/png, ...)") from None


def _looks_like_json(body: Any) -> bool:
    return isinstance(body, (bytes, bytearray)) and bytes(body[:1]) == b"{"


# --------------------------------------------------------------------------- the adapter
class ImageClassificationAdapter(TaskAdapter):
    kind = "image-classification"

    def __init__(self, model_dir, task):
        super().__init__(model_dir, task)
        self.recipe = self.task.get("preprocess") or legacy_recipe(self.task)
        self.height, self.width = check_recipe(self.recipe)
        labels = self.task.get("labels")
        if isinstance(labels, str):              # a file beside the model (task mappings before recipes)
            labels = json.loads((self.model_dir / labels).read_text())
        self.labels = [str(x) for x in labels] if labels else None
        self.top_k = int(self.task.get("top_k", 5))
        self.function = self.task.get("function")
        self.problem_type = self.task.get("problem_type")
        self.max_pixels = int(self.task.get("max_pixels") or MAX_PIXELS)

    def usage(self) -> str:
        return ('send one image (PNG/JPEG/...) as the raw body, e.g. Content-Type image/png, or JSON '
                '{"inputs": "<the image, base64>", "parameters": {"top_k": 5, "function_to_apply": "softmax"}}')

    def decode_request(self, body, content_type=None):
        self.check_body(body)
        media = _media_type(content_type)
        params: dict = {}
        if media in JSON_TYPES or isinstance(body, (dict, list)) or (media == "" and _looks_like_json(body)):
            doc = _parse_json(body)
            if not isinstance(doc, dict):
                raise RequestError(400, f"the JSON body must be an object, got {type(doc).__name__}; {self.usage()}")
            check_keys(doc, ("inputs", "parameters"), "the JSON body", self.usage())
            if "inputs" not in doc:
                raise RequestError(400, f"the JSON body has no `inputs`; {self.usage()}")
            data = image_bytes_of(doc["inputs"], self.usage())
            params = parameters_of(doc, PARAMETERS, self.usage())
        elif media.startswith("text/") or isinstance(body, str):
            raise RequestError(415, f"Content-Type {media or 'text'!r} is not an image; {self.usage()}")
        else:
            data = bytes(body)
        top_k = positive_int(params.get("top_k"), "parameters.top_k", allow_none=True) or self.top_k
        function = params.get("function_to_apply") or self.function
        if function is not None and function not in FUNCTIONS:
            raise RequestError(400, f"parameters.function_to_apply = {function!r}: allowed {', '.join(FUNCTIONS)}")
        pixels = apply_recipe(open_rgb(data, self.max_pixels, self.usage()), self.recipe)
        return Decoded([{"pixels": pixels}], {"top_k": top_k, "function": function})

    def decode(self, body, content_type=None):
        return self.decode_request(body, content_type).rows[0]

    def _decode(self, body, media):      # decode_request is this task's entry point
        raise NotImplementedError

    def label(self, index: int) -> str:
        if self.labels and 0 <= index < len(self.labels):
            return self.labels[index]
        return f"LABEL_{index}"           # transformers' name for a class without one

    def answer(self, logits: np.ndarray, top_k: int, function: Optional[str]) -> list[dict]:
        logits = np.asarray(logits, dtype=np.float32).reshape(-1)
        function = function or default_function(logits.shape[0], self.problem_type)
        scores = scores_of(logits, function)
        order = np.argsort(-scores, kind="stable")[:min(top_k, scores.shape[0])]
        return [{"label": self.label(int(c)), "score": float(scores[c])} for c in order]

    def respond_request(self, row_outputs, meta):
        return self.answer(row_outputs[0][0], meta["top_k"], meta["function"])

    def respond(self, outputs, i):
        return self.answer(outputs[0][i], self.top_k, self.function)

    def example_feeds(self, batch_size, seq_len=None):
        rng = np.random.default_rng(4321 + batch_size)
        pixels = rng.integers(0, 256, size=(batch_size, self.height, self.width, 3), dtype=np.uint8)
        return {"pixels": np.stack([normalize(p, self.recipe) for p in pixels])}

    def example_requests(self, n, seed=0):
        """Smooth backgrounds and shapes (not noise: class scores then have clear winners), in sizes and
        aspect ratios that make the resize and the crop matter; PNG bodies, every third as JSON base64."""
        from PIL import Image, ImageDraw
        rng = random.Random(seed)
        requests = []
        for k in range(n):
            width, height = rng.choice(((64, 48), (48, 80), (96, 64), (56, 56), (40, 72), (120, 90)))
            c0, c1 = ([rng.randint(0, 255) for _ in range(3)] for _ in range(2))
            ramp = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :, None]
            bg = np.asarray(c0, np.float32) * (1 - ramp) + np.asarray(c1, np.float32) * ramp
            img = Image.fromarray(np.repeat(bg, height, axis=0).astype(np.uint8), "RGB")
            draw = ImageDraw.Draw(img)
            for _ in range(rng.randint(1, 4)):
                x0, y0 = rng.randint(0, width // 2), rng.randint(0, height // 2)
                box = (x0, y0, x0 + rng.randint(8, width // 2), y0 + rng.randint(8, height // 2))
                fill = tuple(rng.randint(0, 255) for _ in range(3))
                (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
            if k % 7 == 6:
                img = img.convert("L")               # grayscale files come too: converted to RGB
            buf = io.BytesIO()
            img.save(buf, format="PNG", optimize=False)
            if k % 3 == 2:
                params = {"top_k": self.top_k} if k % 2 else {"function_to_apply": "sigmoid"}
                doc = {"inputs": base64.b64encode(buf.getvalue()).decode("ascii"), "parameters": params}
                requests.append((json.dumps(doc).encode("utf-8"), "application/json"))
            else:
                requests.append((buf.getvalue(), "image/png"))
        return requests
