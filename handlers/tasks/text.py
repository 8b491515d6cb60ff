"""What the tokenized text tasks share (text-classification, rerank, token-classification):
the model folder's fast tokenizer (tokenizer.json), one row per text or text pair, padding to the
batch's longest row in `collate` on the side the folder pads (a decoder backbone: left) with its pad id.

The feeds are the model's inputs as variant.json's task lists them (`inputs`): input_ids,
attention_mask, and token_type_ids only where the model takes them (BERT yes, RoBERTa/DistilBERT no).
Truncation is the tokenizers library's own (the code transformers' fast tokenizers run):
`longest_first` cuts the longer side of a pair, `only_second` only the second text; None refuses
an over-long text with a 413 instead (token-classification: its offsets must cover the whole text).
"""
from __future__ import annotations

import random
from typing import Any, Optional

import numpy as np

from handlers.tasks import _WORDS, RequestError, TaskAdapter

PAD_VALUES = {"attention_mask": 0, "token_type_ids": 0}   # input_ids pad with the tokenizer's pad id


def read_tokenizer(model_dir, task: dict):
    """The folder's tokenizer.json (or the file `task["tokenizer"]` names)."""
    from tokenizers import Tokenizer   # only the text tasks need it
    path = model_dir / task.get("tokenizer", "tokenizer.json")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: tokenizer.json missing from the model folder")
    return Tokenizer.from_file(str(path))


class TextTaskAdapter(TaskAdapter):
    truncation: Optional[str] = "longest_first"

    def __init__(self, model_dir, task):
        super().__init__(model_dir, task)
        self.tokenizer = read_tokenizer(self.model_dir, self.task)
        self.max_length = int(self.task.get("max_length", 128))
        self.max_texts = int(self.task.get("max_texts", 64))
        self.input_names = list(self.task.get("inputs") or ("input_ids", "attention_mask"))
        padding = self.tokenizer.padding or {}
        pad_id = self.task.get("pad_id")      # the folder's pad token (a decoder pads with its end-of-text)
        self.pad_id = int(pad_id if pad_id is not None else padding.get("pad_id", self.tokenizer.token_to_id("[PAD]") or 0))
        self.left_padding = self.task.get("padding_side") == "left"
        # tokenizer.json may ship fixed padding and its own truncation (MiniLM: 128): set ours.
        self.tokenizer.no_padding()
        if self.truncation:
            self.tokenizer.enable_truncation(self.max_length, strategy=self.truncation)
        else:
            self.tokenizer.no_truncation()

    def encode(self, text: str, pair: Optional[str] = None):
        try:
            enc = self.tokenizer.encode(text, pair) if pair is not None else self.tokenizer.encode(text)
        except Exception as e:   # e.g. only_second truncation with a first text over the limit alone
            raise RequestError(413, f"the input does not fit the model's {self.max_length} tokens even after "
                                    f"truncating ({e}); shorten it") from None
        if len(enc.ids) > self.max_length:
            raise RequestError(413, f"the text is {len(enc.ids)} tokens, over the model's limit of "
                                    f"{self.max_length} (model.text.max_length); split it into shorter texts")
        return enc

    def row_of(self, enc) -> dict[str, np.ndarray]:
        values = {"input_ids": enc.ids, "attention_mask": enc.attention_mask, "token_type_ids": enc.type_ids}
        return {name: np.asarray(values[name], dtype=np.int64) for name in self.input_names}

    def decode(self, body, content_type=None):
        decoded = self.decode_request(body, content_type)
        if len(decoded.rows) != 1:
            raise RequestError(400, f"this request makes {len(decoded.rows)} rows; decode takes one-row requests")
        return decoded.rows[0]

    def _decode(self, body, media):   # decode_request is the entry point of these tasks
        raise NotImplementedError

    def collate(self, samples):
        if not samples:
            raise ValueError("collate needs at least one sample")
        longest = max(len(s["input_ids"]) for s in samples)
        feeds = {}
        for name in samples[0]:
            fill = self.pad_id if name == "input_ids" else PAD_VALUES.get(name, 0)
            arr = np.full((len(samples), longest), fill, dtype=np.int64)
            for row, s in enumerate(samples):
                n = len(s[name])
                if self.left_padding:
                    arr[row, longest - n:] = s[name]
                else:
                    arr[row, :n] = s[name]
            feeds[name] = arr
        return feeds

    def example_feeds(self, batch_size, seq_len=None):
        seq_len = int(seq_len or min(self.max_length, 16))
        ids = example_ids(self.tokenizer, batch_size, seq_len)
        feeds = {"input_ids": ids, "attention_mask": np.ones((batch_size, seq_len), dtype=np.int64),
                 "token_type_ids": np.zeros((batch_size, seq_len), dtype=np.int64)}
        return {name: feeds[name] for name in self.input_names}

    @staticmethod
    def sentence(rng: random.Random, low: int = 5, high: int = 15) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(low, high))).capitalize() + "."


def example_ids(tokenizer, batch_size: int, seq_len: int) -> np.ndarray:
    """Deterministic token ids (batch, seq_len) for warm-ups and benchmarks, framed by [CLS] ... [SEP]
    where the vocabulary has them."""
    rng = np.random.default_rng(1234 + batch_size * 1000 + seq_len)
    vocab = tokenizer.get_vocab_size()
    low = min(1000, vocab // 2)   # skip special/unused ids at the start of BERT-style vocabularies
    ids = rng.integers(low, vocab, size=(batch_size, seq_len), dtype=np.int64)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    if cls is not None and sep is not None and seq_len >= 2:
        ids[:, 0], ids[:, -1] = cls, sep
    return ids


def parameters_of(doc: dict, allowed: tuple, usage: str) -> dict:
    """The request's `parameters` mapping (absent: {}), unknown keys refused by name."""
    params = doc.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise RequestError(400, f"`parameters` must be an object, got {type(params).__name__}; {usage}")
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise RequestError(400, f"unknown parameter(s) {unknown}; allowed: {', '.join(allowed)}")
    return params


def positive_int(value: Any, what: str, allow_none: bool = False) -> Optional[int]:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(400, f"{what} = {value!r}: needs an integer >= 1" + (" or null" if allow_none else ""))
    return value


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))
