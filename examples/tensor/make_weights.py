"""Regenerate examples/tensor/weights.safetensors deterministically (seeded init of model.py's build()).

    .venv/bin/python examples/tensor/make_weights.py
"""
from pathlib import Path
import importlib.util

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent


def main() -> Path:
    spec = importlib.util.spec_from_file_location("tensor_example_model", HERE / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model = module.build()
    out = HERE / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out),
              metadata={"generated_by": "examples/tensor/make_weights.py", "seed": "0"})
    return out


if __name__ == "__main__":
    print(f"wrote {main()}")
