"""image-classification: the logits module (an HF image classifier, or a state_dict / TorchScript
model returning one logits tensor), the labels, and the preprocessing recipe the handler applies to
every request (handlers/tasks/image.py, PIL + numpy, no transformers).

The recipe says explicitly what transformers' image processors do: resize (`{"height", "width"}` or
`{"shortest_edge"}`) with a PIL `resample` filter, centre `crop`, `rescale_factor`, per-channel
`mean` / `std`. It comes from
- an HF folder's `preprocessor_config.json`, read through transformers' own PIL image processor
  (so its class defaults and legacy forms, `size: 224`, `crop_pct`, resolve as transformers resolves
  them) and checked against it on sample images of several aspect ratios: a processor type or option
  the recipe cannot express is a `CheckpointError` naming the key and what is supported;
- otherwise params `model.image` (`size` or `resize_shortest_edge` + `crop_size`, `resample`,
  `rescale_factor`, `mean`, `std`; by default a 224×224 resize and (pixel − 127) / 128).
Labels: config.json's `id2label` (hf) or `model.image.labels` (a JSON list); the score function as
transformers chooses it, unless `model.image.function_to_apply` says.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from handlers.tasks.classification import default_function
from handlers.tasks.image import RESAMPLE, apply_recipe, check_recipe
from pipeline.core.params import ImageParams, Params, checkpoint_path, resolve_path
from pipeline.model.families.base import Family, OutputsAsTuple, describe_outputs, labels_of, register
from pipeline.model.loaded import InputSpec, LoadedModel
from pipeline.model.sources import load_eval
from pipeline.model.weights import CheckpointError, KeyReport

log = logging.getLogger(__name__)

PROCESSOR_FILE = "preprocessor_config.json"
# Processors whose images take transformers' generic path (PilBackend._preprocess: resize → centre
# crop → rescale → normalize), and ConvNeXT's, whose resize applies crop_pct below 384 pixels.
GENERIC_PROCESSORS = ("ViTImageProcessor", "DeiTImageProcessor", "BeitImageProcessor", "CLIPImageProcessor",
                      "BitImageProcessor", "MobileNetV1ImageProcessor", "MobileNetV2ImageProcessor",
                      "SiglipImageProcessor", "PvtImageProcessor")
CONVNEXT = "ConvNextImageProcessor"
SUPPORTED_PROCESSORS = (*GENERIC_PROCESSORS, CONVNEXT)
RECIPE_KEYS = ("size", "resize_shortest_edge", "crop_size", "resample", "rescale_factor", "mean", "std")
SAMPLE_SIZES = ((61, 47), (40, 90), (300, 200), (33, 33))     # (width, height): the agreement check's images
DEFAULT_SIZE, DEFAULT_MEAN, DEFAULT_STD = 224, 127.0, 128.0


def _pair(value: Any) -> tuple[int, int]:
    """An int (square) or [height, width]."""
    return (int(value), int(value)) if isinstance(value, int) else (int(value[0]), int(value[1]))


def _three(value: Any) -> list[float]:
    return [float(v) for v in value] if isinstance(value, (list, tuple)) else [float(value)] * 3


# --------------------------------------------------------------------------- from params
def recipe_from_params(img: ImageParams) -> dict:
    """The recipe params `model.image` describe (validated by pipeline/core/params_checks.py)."""
    size = img.size if img.size is not None or img.resize_shortest_edge or img.crop_size else DEFAULT_SIZE
    if img.resize_shortest_edge:
        resize = {"shortest_edge": int(img.resize_shortest_edge)}
    elif size is not None:
        height, width = _pair(size)
        resize = {"height": height, "width": width}
    else:
        resize = None
    crop = None
    if img.crop_size is not None:
        height, width = _pair(img.crop_size)
        crop = {"height": height, "width": width}
    return {"resize": resize, "resample": img.resample or "bilinear", "crop": crop,
            "rescale_factor": img.rescale_factor,
            "mean": _three(DEFAULT_MEAN if img.mean is None else img.mean),
            "std": _three(DEFAULT_STD if img.std is None else img.std), "from": "params model.image"}


# --------------------------------------------------------------------------- from preprocessor_config.json
def processor_type(path: Path, raw: dict) -> str:
    """The processor's class name without a backend suffix (…Fast, …Pil); old FeatureExtractor names too."""
    name = raw.get("image_processor_type") or raw.get("feature_extractor_type")
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{path}: names no `image_processor_type`; supported: {', '.join(SUPPORTED_PROCESSORS)} "
                              f"(or delete the file and describe the preprocessing in params model.image)")
    base = name.removesuffix("Fast").removesuffix("Pil").replace("FeatureExtractor", "ImageProcessor")
    if base not in SUPPORTED_PROCESSORS:
        raise CheckpointError(f"{path}: `image_processor_type` {name!r} is not supported: its preprocessing is its "
                              f"own. Supported: {', '.join(SUPPORTED_PROCESSORS)}; or delete the file and describe the "
                              f"preprocessing in params model.image (size / resize_shortest_edge, crop_size, resample, "
                              f"rescale_factor, mean, std)")
    return base


def _unsupported(path: Path, key: str, value: Any, supported: str) -> CheckpointError:
    return CheckpointError(f"{path}: `{key}` = {value!r} is not supported; supported: {supported}")


def recipe_from_processor(folder: Path) -> dict:
    """The recipe of the folder's preprocessor_config.json, as transformers resolves it."""
    path = folder / PROCESSOR_FILE
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from None
    base = processor_type(path, raw)
    import transformers
    cls = getattr(transformers, base + "Pil", None)        # the PIL backend: what the handler reproduces
    if cls is None:
        raise CheckpointError(f"{path}: transformers {transformers.__version__} has no {base}Pil; "
                              f"install the version requirements.txt pins")
    try:
        proc = cls.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:
        raise CheckpointError(f"{path}: transformers cannot read it: {type(e).__name__}: {e}") from None
    recipe = _recipe_of(path, base, proc)
    try:
        check_recipe(recipe)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    _check_agreement(path, proc, recipe)
    return recipe


def _recipe_of(path: Path, base: str, proc) -> dict:
    if getattr(proc, "do_pad", None):
        raise _unsupported(path, "do_pad", proc.do_pad, "false (the model takes one fixed size)")
    size, crop_size = proc.size, proc.crop_size
    resize = crop = None
    if proc.do_resize:
        if base == CONVNEXT:
            if not size or not size.shortest_edge or size.height or size.longest_edge:
                raise _unsupported(path, "size", dict(size or {}), '{"shortest_edge": N} for ConvNextImageProcessor')
            edge = int(size.shortest_edge)
            if edge < 384:            # ConvNeXT: resize the short side to edge / crop_pct, crop edge × edge
                if proc.do_center_crop:
                    raise _unsupported(path, "do_center_crop", True, "false with crop_pct (ConvNextImageProcessor "
                                                                     "already crops below 384)")
                resize = {"shortest_edge": int(edge / float(proc.crop_pct))}
                crop = {"height": edge, "width": edge}
            else:                     # from 384 on: warped to edge × edge, no crop
                resize = {"height": edge, "width": edge}
        elif size and size.height and size.width and not size.shortest_edge:
            resize = {"height": int(size.height), "width": int(size.width)}
        elif size and size.shortest_edge and not size.longest_edge and not size.height:
            resize = {"shortest_edge": int(size.shortest_edge)}
        else:
            raise _unsupported(path, "size", {k: v for k, v in dict(size or {}).items() if v is not None},
                               '{"height": H, "width": W} or {"shortest_edge": N}')
    if proc.do_center_crop:
        if not crop_size or not crop_size.height or not crop_size.width:
            raise _unsupported(path, "crop_size", dict(crop_size or {}), '{"height": H, "width": W} with do_center_crop')
        crop = {"height": int(crop_size.height), "width": int(crop_size.width)}
    resample = proc.resample if proc.resample is not None else RESAMPLE["bilinear"]
    names = {code: name for name, code in RESAMPLE.items()}
    code = int(getattr(resample, "value", resample))
    if code not in names:
        raise _unsupported(path, "resample", resample, ", ".join(f"{c} ({n})" for c, n in names.items()))
    mean = std = None
    if proc.do_normalize:
        mean, std = _three(proc.image_mean), _three(proc.image_std)
    return {"resize": resize, "resample": names[code], "crop": crop,
            "rescale_factor": float(proc.rescale_factor) if proc.do_rescale else None,
            "mean": mean, "std": std, "from": f"{PROCESSOR_FILE}: {base}"}


def _check_agreement(path: Path, proc, recipe: dict) -> None:
    """The recipe against transformers' own processor on a few images of other aspect ratios."""
    from PIL import Image
    rng = np.random.default_rng(0)
    for width, height in SAMPLE_SIZES:
        img = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
        want = np.asarray(proc(images=img, return_tensors="np")["pixel_values"][0], dtype=np.float32)
        got = apply_recipe(img, recipe)
        if got.shape != want.shape or float(np.abs(got - want).max()) > 1e-4:
            diff = "shape " + str(got.shape) if got.shape != want.shape else f"max |diff| {np.abs(got - want).max():.3g}"
            raise CheckpointError(f"{path}: the recipe read from it ({recipe}) does not reproduce transformers' "
                                  f"{type(proc).__name__} on a {width}x{height} image ({diff} vs {want.shape}); "
                                  f"an option of it is not supported: describe the preprocessing in params model.image")


# --------------------------------------------------------------------------- the task model
def image_recipe(params: Params, folder: Optional[Path]) -> dict:
    """preprocessor_config.json for an HF folder that has one (params must then not say it again), else params."""
    img = params.model.image
    if folder is not None and (folder / PROCESSOR_FILE).is_file():
        given = [k for k in RECIPE_KEYS if getattr(img, k) is not None]
        if given:
            raise CheckpointError(f"`model.image.{given[0]}` is set, but {folder / PROCESSOR_FILE} already says how "
                                  f"images are preprocessed; remove {', '.join('model.image.' + k for k in given)} "
                                  f"(or delete the file to describe the preprocessing in params)")
        return recipe_from_processor(folder)
    return recipe_from_params(img)


def _labels(params: Params, module: nn.Module, folder: Optional[Path], num_classes: int) -> Optional[list[str]]:
    img = params.model.image
    if img.labels:
        labels_path = resolve_path(img.labels)
        try:
            labels = json.loads(labels_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"`model.image.labels` -> {labels_path}: cannot read a JSON list ({e})") from None
        if not isinstance(labels, list) or len(labels) != num_classes:
            raise CheckpointError(f"`model.image.labels` -> {labels_path}: needs a JSON list of {num_classes} names "
                                  f"(one per class), got {type(labels).__name__} of "
                                  f"{len(labels) if isinstance(labels, list) else '?'}")
        return [str(x) for x in labels]
    config = getattr(module, "config", None)
    if folder is not None and config is not None:
        return labels_of(config, folder)
    return None


def image_classification_model(params: Params, module: nn.Module, sources: list[Path], wrapped: nn.Module,
                               folder: Optional[Path]):
    """The LoadedModel of an image classifier; `wrapped` returns the logits of `module`."""
    recipe = image_recipe(params, folder)
    try:
        height, width = check_recipe(recipe)
    except ValueError as e:
        raise CheckpointError(f"image-classification preprocessing ({recipe['from']}): {e}") from None
    with torch.inference_mode():
        try:
            logits = wrapped(torch.zeros(1, 3, height, width))
        except Exception as e:
            raise CheckpointError(f"image-classification: the model fails on a [1, 3, {height}, {width}] input (the "
                                  f"preprocessing's output, {recipe['from']}): {type(e).__name__}: {e}") from None
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise CheckpointError(f"image-classification: the model must return logits [batch, classes]; got "
                              f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    num_classes = int(logits.shape[1])
    img = params.model.image
    config = getattr(module, "config", None)
    problem_type = getattr(config, "problem_type", None) if config is not None else None
    task = {"kind": "image-classification", "input_size": [height, width], "preprocess": recipe,
            "top_k": min(img.top_k, num_classes), "num_classes": num_classes,
            "labels": _labels(params, module, folder, num_classes), "problem_type": problem_type,
            "function": img.function_to_apply or default_function(num_classes, problem_type),
            "max_pixels": img.max_pixels}
    log.info("image-classification: %d classes, input %dx%d, preprocessing from %s", num_classes, height, width,
             recipe["from"])
    return LoadedModel(module=wrapped.eval(), inputs=[InputSpec("pixels", "float32", {0: "batch"})],
                       outputs=["logits"], task=task, extra_files={}, source_files=sources)


def probe_size(params: Params) -> tuple[int, int]:
    """The (height, width) a state_dict / TorchScript image model takes, from params `model.image`."""
    return check_recipe(recipe_from_params(params.model.image))


@register
class ImageClassification(Family):
    name = "image-classification"
    tasks = ("image-classification",)

    def hf_class(self, task: str) -> str:
        return "AutoModelForImageClassification"

    def load(self, params: Params, path: Path) -> tuple[LoadedModel, Optional[KeyReport]]:
        """The logits of the model (one output), its labels and its preprocessing."""
        module, sources, report = load_eval(params, path, self.hf_class(params.model.task))
        if params.model.source == "hf":
            wrapped = OutputsAsTuple(module, pick="logits")
        else:
            example = torch.zeros(1, 3, *probe_size(params))
            names, keys = describe_outputs(module, example)
            if len(names) != 1:
                raise CheckpointError(f"image-classification needs one logits output; the model returns {len(names)} "
                                      f"({', '.join(names)}); use task 'tensor' or make the factory return logits only")
            wrapped = OutputsAsTuple(module, keys=None, pick=keys[0] if keys else None)
        folder = checkpoint_path(params) if params.model.source == "hf" else None
        return image_classification_model(params, module, sources, wrapped.eval(), folder), report
