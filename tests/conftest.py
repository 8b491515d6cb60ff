"""Shared fixtures: tiny models and checkpoints for every task, built in seconds on a CPU.

- `make_params(model={...}, **sections)`: validated Params with small test defaults.
- `factory_file`: a .py file with tiny factories (absolute path; use as "<path>:build_cnn").
- `tiny_text_model_dir`: a tiny BERT Hugging Face folder (safetensors, tokenizer.json with fixed
  padding like MiniLM's, sentence-transformers modules.json + 1_Pooling) for text-embedding.
- `text_params`, `image_params`, `tensor_params`: Params for each task on those tiny models
  (`tensor_params` uses the committed examples/tensor model).
"""
from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Stage scripts the tests run (in-process or as subprocesses) record their wall time here, not in
# the repo's metrics/stages/ (the pipeline's own committed records).
os.environ.setdefault("PIPELINE_STAGE_METRICS", tempfile.mkdtemp(prefix="test-stage-metrics-"))
# The shared ONNX export (pipeline/build/variants/export_cache.py) of the tests' tiny models: not in ~/.cache.
os.environ["PIPELINE_CACHE_DIR"] = tempfile.mkdtemp(prefix="test-pipeline-cache-")

from pipeline.core.params import parse_params  # noqa: E402

TEST_BATCH_SIZES = [1, 2, 4]

TINY_FACTORIES = '''
"""Tiny factories for tests (written by tests/conftest.py)."""
import torch
from torch import nn


class TinyCNN(nn.Module):
    def __init__(self, classes=5):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, classes)

    def forward(self, x):
        return self.fc(self.pool(torch.relu(self.conv(x))).flatten(1))


class TwoHeads(nn.Module):
    def __init__(self, features=8):
        super().__init__()
        self.a = nn.Linear(features, 3)
        self.b = nn.Linear(features, 2)

    def forward(self, x):
        return self.a(x), self.b(x)


class DictOut(TwoHeads):
    def forward(self, x):
        return {"scores": self.a(x), "extra": self.b(x)}


def build_cnn(classes=5):
    torch.manual_seed(0)
    return TinyCNN(classes)


def build_mlp(features=8, out=3):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, out))


def build_two_heads(features=8):
    torch.manual_seed(0)
    return TwoHeads(features)


def build_dict_out(features=8):
    torch.manual_seed(0)
    return DictOut(features)


def build_fails():
    raise RuntimeError("factory exploded on purpose")


def build_not_module():
    return {"not": "a module"}


NOT_CALLABLE = 42
'''

# Words the tiny tokenizer knows: those handlers.tasks uses for example sentences, plus the test's.
EXTRA_WORDS = "hello world man is playing a guitar someone strumming stock market fell sharply today".split()


def _base_params(model: dict) -> dict:
    return {
        "model": model,
        "variants": ["eager"],
        "benchmark": {"batch_sizes": list(TEST_BATCH_SIZES)},
        "conversion": {"golden_batches": 2},
    }


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


@pytest.fixture(scope="session")
def make_params():
    """make_params(model={...}, benchmark={...}, ...) -> validated Params (nested dicts merge)."""
    def build(model: dict, **sections):
        return parse_params(_merge(_base_params(model), sections))
    return build


@pytest.fixture(scope="session")
def factory_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("factories") / "tiny_factories.py"
    path.write_text(TINY_FACTORIES)
    return path


@pytest.fixture(scope="session")
def tiny_text_model_dir(tmp_path_factory) -> Path:
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel

    from handlers.tasks import _WORDS

    folder = tmp_path_factory.mktemp("tiny_text_model")
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = sorted(set(_WORDS) | set(EXTRA_WORDS) | {".", ",", "!", "?", "'"})
    vocab = {tok: i for i, tok in enumerate(specials + words)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tok.enable_truncation(48)
    tok.enable_padding(length=48, pad_id=0, pad_token="[PAD]")   # fixed padding, like MiniLM's 128
    tok.save(str(folder / "tokenizer.json"))

    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    BertModel(config).eval().save_pretrained(str(folder))   # config.json + model.safetensors
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}))
    return folder


@pytest.fixture
def text_params(make_params, tiny_text_model_dir):
    return make_params({"name": "tiny-text", "source": "hf", "checkpoint": str(tiny_text_model_dir),
                        "task": "text-embedding", "text": {"max_length": 32}})


@pytest.fixture(scope="session")
def tiny_cnn_checkpoint(tmp_path_factory, factory_file) -> Path:
    """A state_dict .pt for factory `build_cnn` (5 classes)."""
    import importlib.util

    import torch
    spec = importlib.util.spec_from_file_location("tiny_factories_for_weights", factory_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = tmp_path_factory.mktemp("tiny_cnn") / "cnn.pt"
    torch.save(module.build_cnn().state_dict(), path)
    return path


@pytest.fixture
def image_params(make_params, factory_file, tiny_cnn_checkpoint):
    return make_params({"name": "tiny-cnn", "source": "state_dict", "checkpoint": str(tiny_cnn_checkpoint),
                        "factory": f"{factory_file}:build_cnn", "task": "image-classification",
                        "image": {"size": 32, "top_k": 3}})


@pytest.fixture
def tensor_params(make_params):
    """The committed tensor example (examples/tensor): tiny, and its code lives in the repo."""
    return make_params({"name": "signalnet", "source": "state_dict",
                        "checkpoint": "examples/tensor/weights.safetensors",
                        "factory": "examples/tensor/model.py:build", "task": "tensor",
                        "input_shape": [16, 32]})
