"""Build a small Hugging Face image classifier with random weights from a seed and the preprocessor_config.json
of the real checkpoints of its family, for scripts/served_vs_transformers.py (no network):
- `resnet`: ResNetForImageClassification (basic blocks, 4 stages) with microsoft/resnet-50's
  ConvNextImageProcessor (shortest edge 224, crop_pct 0.875, bicubic, ImageNet mean/std);
- `mobilenet_v2`: MobileNetV2ForImageClassification (depth multiplier 0.35) with google/mobilenet_v2's
  MobileNetV2ImageProcessor (shortest edge 256, centre crop 224, bilinear, mean/std 0.5).
The classifier's weights are scaled up so class scores are spread (clear winners, not near ties that
float rounding could reorder).

    python scripts/make_image_task_model.py --arch resnet --out /tmp/resnet-tiny [--seed 0]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

LABELS = ["tench", "goldfish", "great white shark", "tiger shark", "hammerhead", "electric ray", "stingray",
          "cock", "hen", "ostrich", "brambling", "goldfinch"]
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
ARCHES = ("resnet", "mobilenet_v2")


def build(out: Path, arch: str = "resnet", seed: int = 0, spread: float = 25.0) -> Path:
    import torch
    import transformers
    labels = {"id2label": dict(enumerate(LABELS)), "label2id": {n: i for i, n in enumerate(LABELS)}}
    torch.manual_seed(seed)
    if arch == "resnet":
        config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                                           layer_type="basic", num_labels=len(LABELS), **labels)
        model = transformers.ResNetForImageClassification(config)
        processor = transformers.ConvNextImageProcessorPil(size={"shortest_edge": 224}, crop_pct=0.875, resample=3,
                                                           image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD)
    elif arch == "mobilenet_v2":
        config = transformers.MobileNetV2Config(depth_multiplier=0.35, image_size=224, num_labels=len(LABELS),
                                                **labels)
        model = transformers.MobileNetV2ForImageClassification(config)
        processor = transformers.MobileNetV2ImageProcessorPil(size={"shortest_edge": 256},
                                                              crop_size={"height": 224, "width": 224}, resample=2,
                                                              image_mean=[0.5] * 3, image_std=[0.5] * 3)
    else:
        raise SystemExit(f"--arch {arch!r}: one of {', '.join(ARCHES)}")
    head = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
    with torch.no_grad():
        head.weight.mul_(spread)
    out.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(str(out))
    processor.save_pretrained(str(out))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="resnet", choices=ARCHES)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(build(args.out, args.arch, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
