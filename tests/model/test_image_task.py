"""The image preprocessing recipe (pipeline/model/families/image_classification.py) against transformers' own image
processors: the handler's pixels (handlers/tasks/image.py, PIL + numpy) equal the processor's within
1e-5 on images of several sizes and aspect ratios, through the same path a request takes (the
encoded file, EXIF orientation, RGB); and every processor type or option the recipe cannot express
is refused by name."""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from handlers.tasks import make_adapter
from pipeline.model.checkpoint import CheckpointError, load_model
from pipeline.model.families.image_classification import recipe_from_params, recipe_from_processor

transformers = pytest.importorskip("transformers")

# (width, height): landscape, portrait, large, square, very wide (a crop larger than the resized image pads).
SIZES = [(61, 47), (40, 90), (300, 200), (33, 33), (250, 20)]
PROCESSORS = {
    # ViT: an exact (non-square) resize, per-channel mean/std.
    "vit": lambda: transformers.ViTImageProcessorPil(size={"height": 24, "width": 40}, resample=3,
                                                     image_mean=[0.45, 0.5, 0.55], image_std=[0.2, 0.25, 0.3]),
    # ConvNeXT below 384: the short side to int(32 / 0.8) = 40, then the centre 32 x 32.
    "convnext": lambda: transformers.ConvNextImageProcessorPil(size={"shortest_edge": 32}, crop_pct=0.8),
    # ConvNeXT from 384 on: warped to 384 x 384.
    "convnext-384": lambda: transformers.ConvNextImageProcessorPil(size={"shortest_edge": 384}),
    # CLIP-style: shortest edge + centre crop, OpenAI's mean/std, bicubic.
    "clip": lambda: transformers.CLIPImageProcessorPil(size={"shortest_edge": 36}, crop_size={"height": 32, "width": 32}),
    # DeiT: exact resize then crop; BiT: a crop larger than the resize (zero padding).
    "deit": lambda: transformers.DeiTImageProcessorPil(size={"height": 40, "width": 36}, crop_size=32),
    "bit-pad": lambda: transformers.BitImageProcessorPil(size={"shortest_edge": 20}, crop_size={"height": 36, "width": 30}),
    # Rescale without normalisation, nearest.
    "vit-plain": lambda: transformers.ViTImageProcessorPil(size={"height": 16, "width": 16}, do_normalize=False,
                                                           resample=0),
}


def encoded(width: int, height: int, seed: int, fmt: str = "PNG", mode: str = "RGB", orientation: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB").convert(mode)
    buf = io.BytesIO()
    if orientation:
        exif = Image.Exif()
        exif[0x0112] = orientation
        img.save(buf, format=fmt, exif=exif)
    else:
        img.save(buf, format=fmt)
    return buf.getvalue()


def transformers_pixels(proc, body: bytes) -> np.ndarray:
    """What the image-classification pipeline feeds the model: load_image (EXIF, RGB), then the processor."""
    from transformers.image_utils import load_image
    return np.asarray(proc(images=load_image(Image.open(io.BytesIO(body))), return_tensors="np")["pixel_values"][0])


def folder_with(tmp_path: Path, proc) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    proc.save_pretrained(str(folder))
    return folder


@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_recipe_reproduces_transformers_processor(tmp_path, name):
    proc = PROCESSORS[name]()
    recipe = recipe_from_processor(folder_with(tmp_path, proc))
    adapter = make_adapter(tmp_path, {"kind": "image-classification", "preprocess": recipe})
    bodies = [encoded(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    bodies += [encoded(50, 30, 9, "JPEG", orientation=6),     # EXIF: rotated 90 degrees, upright after loading
               encoded(45, 70, 10, mode="L"), encoded(70, 45, 11, mode="RGBA")]
    for body in bodies:
        want = transformers_pixels(proc, body)
        got = adapter.decode(body, "image/png")["pixels"]
        assert got.shape == want.shape and got.dtype == np.float32
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_convnext_recipe_is_explicit(tmp_path):
    recipe = recipe_from_processor(folder_with(tmp_path, PROCESSORS["convnext"]()))
    assert recipe["resize"] == {"shortest_edge": 40} and recipe["crop"] == {"height": 32, "width": 32}
    assert recipe["resample"] == "bicubic" and recipe["rescale_factor"] == pytest.approx(1 / 255)
    assert recipe["mean"] == [0.5] * 3 and recipe["from"] == "preprocessor_config.json: ConvNextImageProcessor"


def write_config(tmp_path: Path, config: dict) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "preprocessor_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("config, words", [
    ({"image_processor_type": "LevitImageProcessor"}, ["`image_processor_type` 'LevitImageProcessor'",
                                                       "ViTImageProcessor", "ConvNextImageProcessor"]),
    ({"size": 224}, ["names no `image_processor_type`"]),
    ({"image_processor_type": "ViTImageProcessor", "size": {"shortest_edge": 20, "longest_edge": 40}},
     ["`size`", "longest_edge", '{"height": H, "width": W} or {"shortest_edge": N}']),
    ({"image_processor_type": "ViTImageProcessor", "do_pad": True, "pad_size": {"height": 8, "width": 8}},
     ["`do_pad` = True"]),
    ({"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 20}, "do_center_crop": False},
     ["input size varies"]),
    ({"image_processor_type": "ConvNextImageProcessor", "size": {"height": 20, "width": 20}},
     ["`size`", "shortest_edge"]),
    ({"image_processor_type": "ViTImageProcessor", "resample": 7}, ["resample"]),
])
def test_unsupported_processors_and_options_are_named(tmp_path, config, words):
    with pytest.raises(CheckpointError) as info:
        recipe_from_processor(write_config(tmp_path, config))
    assert all(w in str(info.value) for w in words), str(info.value)


def test_old_feature_extractor_names_and_int_sizes_resolve_as_transformers(tmp_path):
    folder = write_config(tmp_path, {"feature_extractor_type": "ViTFeatureExtractor", "size": 20, "resample": 2,
                                     "image_mean": 0.5, "image_std": 0.5, "do_normalize": True})
    recipe = recipe_from_processor(folder)
    assert recipe["resize"] == {"height": 20, "width": 20} and recipe["mean"] == [0.5] * 3


def test_recipe_from_params_defaults_and_explicit(make_params, factory_file, tiny_cnn_checkpoint):
    base = {"name": "c", "source": "state_dict", "checkpoint": str(tiny_cnn_checkpoint),
            "factory": f"{factory_file}:build_cnn", "task": "image-classification"}
    default = recipe_from_params(make_params(base).model.image)
    assert default["resize"] == {"height": 224, "width": 224} and default["crop"] is None
    assert default["mean"] == [127.0] * 3 and default["std"] == [128.0] * 3 and default["rescale_factor"] is None
    image = {"resize_shortest_edge": 40, "crop_size": [32, 36], "resample": "bicubic",
             "rescale_factor": 0.00392156862745098, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
    params = make_params({**base, "image": image})
    recipe = recipe_from_params(params.model.image)
    assert recipe["resize"] == {"shortest_edge": 40} and recipe["crop"] == {"height": 32, "width": 36}
    loaded = load_model(params)             # the CNN pools: any input size
    assert loaded.task["input_size"] == [32, 36] and loaded.task["preprocess"]["resample"] == "bicubic"


def tiny_vit(folder: Path, problem_type=None, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    config = transformers.ViTConfig(image_size=(24, 40), patch_size=8, num_channels=3, hidden_size=16,
                                    num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                    num_labels=3, id2label={0: "cat", 1: "dog", 2: "owl"},
                                    label2id={"cat": 0, "dog": 1, "owl": 2}, problem_type=problem_type)
    transformers.ViTForImageClassification(config).eval().save_pretrained(str(folder))
    PROCESSORS["vit"]().save_pretrained(str(folder))
    return folder


def test_hf_folder_gives_labels_recipe_and_score_function(tmp_path, make_params):
    folder = tiny_vit(tmp_path / "vit", problem_type="multi_label_classification")
    model = {"name": "v", "source": "hf", "checkpoint": str(folder), "task": "image-classification"}
    loaded = load_model(make_params(model))
    task = loaded.task
    assert task["labels"] == ["cat", "dog", "owl"] and task["function"] == "sigmoid" and task["top_k"] == 3
    assert task["input_size"] == [24, 40] and task["preprocess"]["resize"] == {"height": 24, "width": 40}
    assert loaded.module(torch.zeros(2, 3, 24, 40)).shape == (2, 3)
    with pytest.raises(CheckpointError, match=r"`model.image.size` is set, but .*preprocessor_config.json"):
        load_model(make_params({**model, "image": {"size": 24}}))
