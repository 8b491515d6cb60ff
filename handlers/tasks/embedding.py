"""text-embedding: one vector per text, computed as the folder's sentence-transformers modules do.

Requests, two shapes:
- this project's own: text/plain, a bare JSON string, or JSON {"text": "..."} → {"embedding": [...]};
- Hugging Face's (TEI's /embed, the HF Inference API, what `huggingface_hub.InferenceClient
  .feature_extraction` POSTs): JSON {"inputs": "..." | ["...", ...]} → a LIST of vectors, one per
  text, `[[...]]` for one text (TEI's answer, the float32 matrix InferenceClient parses).
Options, in either JSON shape (TEI's and InferenceClient's names): `prompt_name` (one of the folder's
prompts, config_sentence_transformers.json; the folder's default prompt when none is named, as
sentence-transformers does); `truncate` (true: cut to the model's length as sentence-transformers does;
absent/false: a text over the length is a 413 naming it, never a silently different answer) and
`truncation_direction` ("right", the default, or "left": which end a truncated text loses);
`normalize` (true: unit vectors, in fp32; false: the pooled vector as it is, refused for a model whose
modules end with Normalize; absent: as the model's modules say); `dimensions` (only the model's own
width: vectors are never shortened); `encoding_format: "base64"` answers OpenAI's compact form
(little-endian float32, base64): {"embedding": "<base64>", "encoding_format": "base64"} for the own
shape, a list of base64 strings for the `inputs` shape. Anything else is a 400 naming the key.

The tokenizer is the folder's as it defines it: its post-processor's tokens (a decoder backbone's
appended end-of-text), its pad id and its padding side (a decoder pads LEFT); a batch of mixed lengths
gives every row the answer it gets alone (the pooling reads the attention mask only). A folder pooled
with include_prompt false gets a third input, `pooling_mask`: the attention mask with the prompt's
tokens zeroed, the prompt's length counted as sentence-transformers counts it (the prompt tokenized
alone, a trailing special token not counted).
"""
from __future__ import annotations

import base64
import json
import random

import numpy as np

from handlers.encode import json_bytes
from handlers.tasks.text import example_ids, read_tokenizer
from handlers.tasks import (_WORDS, JSON_TYPES, Decoded, RequestError, TaskAdapter, _media_type, _parse_json,
                            _text_of, check_count, check_keys, check_text)

REQUEST_KEYS = ("text", "inputs", "prompt_name", "truncate", "truncation_direction", "normalize", "dimensions",
                "encoding_format")
DIRECTIONS = ("right", "left")


class Options:
    """A request's options, checked: the prompt text, truncation, normalisation and the answer's encoding."""
    __slots__ = ("prompt", "truncate", "direction", "normalize", "encoding")

    def __init__(self, prompt: str = "", truncate: bool = False, direction: str = "right",
                 normalize=None, encoding: str = "float"):
        self.prompt, self.truncate, self.direction = prompt, truncate, direction
        self.normalize, self.encoding = normalize, encoding


class TextEmbeddingAdapter(TaskAdapter):
    kind = "text-embedding"

    def __init__(self, model_dir, task):
        super().__init__(model_dir, task)
        from tokenizers import Tokenizer   # a second one truncates, for the requests that ask
        self.tokenizer = read_tokenizer(self.model_dir, self.task)
        self.max_length = int(self.task.get("max_length", 128))
        self.normalize = bool(self.task.get("normalize", False))
        self.max_texts = int(self.task.get("max_texts", 64))
        self.prompts = dict(self.task.get("prompts") or {})
        self.default_prompt = self.task.get("default_prompt_name")
        self.include_prompt = self.task.get("include_prompt", True) is not False
        self.prompt_lengths: dict[str, int] = {}
        self.left_padding = self.task.get("padding_side") == "left"
        if self.task.get("pad_id") is not None:
            self.pad_id = int(self.task["pad_id"])
        else:
            padding = self.tokenizer.padding or {}
            pad_token = next((t for t in ("[PAD]", "<pad>") if self.tokenizer.token_to_id(t) is not None), None)
            self.pad_id = int(padding.get("pad_id", self.tokenizer.token_to_id(pad_token) if pad_token else 0))
        # tokenizer.json may ship fixed padding (MiniLM: 128) and its own truncation: padding is per
        # batch in collate; a second tokenizer truncates, for the requests that ask for it.
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        self.truncating = {}
        for direction in DIRECTIONS:
            self.truncating[direction] = Tokenizer.from_str(self.tokenizer.to_str())
            self.truncating[direction].enable_truncation(self.max_length, direction=direction)
        self.dim = int(self.task["dim"]) if self.task.get("dim") else None

    def usage(self) -> str:
        prompts = f', "prompt_name": one of {sorted(self.prompts)}' if self.prompts else ""
        return ('send text as text/plain, or JSON {"text": "..."} (answers {"embedding": [...]}) or {"inputs": '
                '"..." | ["...", ...]} (answers a list of embeddings, one per text), optionally with "truncate": '
                f'true{prompts}, Content-Type application/json')

    def decode_request(self, body, content_type=None):
        media = _media_type(content_type)
        if media in JSON_TYPES or isinstance(body, (dict, list)):
            self.check_body(body)
            doc = _parse_json(body)
            if isinstance(doc, dict) and "inputs" in doc and "text" not in doc:
                # Hugging Face's shape (TEI /embed, InferenceClient.feature_extraction): a list of vectors.
                check_keys(doc, REQUEST_KEYS, "the request", self.usage())
                texts = doc["inputs"]
                single = not isinstance(texts, list)
                items = [texts] if single else texts
                if not items:
                    raise RequestError(400, f"`inputs` is an empty list; {self.usage()}")
                check_count(len(items), self.max_texts)
                options = self._options(doc)
                rows = []
                for i, t in enumerate(items):
                    what = "inputs" if single else f"inputs[{i}]"
                    text = check_text(t, what, self.usage())
                    rows.append(self._encode(text, options.prompt, options.truncate, what, options.direction))
                return Decoded(rows, {"many": True, "normalize": options.normalize, "encoding": options.encoding})
        sample = self.decode(body, content_type)
        return Decoded([sample], {"many": False, "normalize": sample.get("normalize"),
                                  "encoding": sample.get("encoding_format", "float")})

    def respond_request(self, row_outputs, meta):
        return self._answer(row_outputs, meta, lambda v: v.tolist())

    def respond_request_bytes(self, row_outputs, decoded):
        return json_bytes(self._answer(row_outputs, decoded.meta, lambda v: v))

    def _answer(self, row_outputs, meta, as_floats):
        """The own shape {"embedding": ...} for one text, or Hugging Face's list of vectors (`many`)."""
        meta = meta or {}
        encoding = meta.get("encoding", "float")
        vectors = [self.vector([r[0][None]], 0, meta.get("normalize")) for r in row_outputs]
        values = [_b64(v) if encoding == "base64" else as_floats(v) for v in vectors]
        if meta.get("many"):
            return values
        if encoding == "base64":
            return {"embedding": values[0], "encoding_format": "base64"}
        return {"embedding": values[0]}

    def _options(self, doc: dict) -> Options:
        """The request's options checked (module doc); a 400 naming the key and the fix otherwise."""
        name = doc.get("prompt_name")
        if name is not None and not isinstance(name, str):
            raise RequestError(400, f"`prompt_name` must be a string, got {type(name).__name__}; {self.usage()}")
        if name is not None and name not in self.prompts:
            raise RequestError(400, f"`prompt_name` {name!r} is not one of this model's prompts: "
                                    + (", ".join(sorted(self.prompts)) if self.prompts else "it has none"))
        truncate = doc.get("truncate", False)
        if truncate is None:
            truncate = False
        if not isinstance(truncate, bool):
            raise RequestError(400, f"`truncate` must be true or false, got {truncate!r}")
        direction = doc.get("truncation_direction")
        direction = "right" if direction is None else direction
        if not isinstance(direction, str) or direction.lower() not in DIRECTIONS:
            raise RequestError(400, f"`truncation_direction` is {direction!r}: use \"right\" (the default: a "
                                    f"truncated text loses its end) or \"left\" (it loses its start)")
        normalize = doc.get("normalize")
        if normalize is not None and not isinstance(normalize, bool):
            raise RequestError(400, f"`normalize` must be true or false, got {normalize!r}")
        if normalize is False and self.normalize:
            raise RequestError(400, "`normalize` is false, but this model's sentence-transformers modules end with "
                                    "Normalize: its vectors are unit length by construction and the unnormalised "
                                    "ones are not served; drop `normalize` or send true")
        dimensions = doc.get("dimensions")
        if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)
                                       or dimensions != self.dim):
            width = f"{self.dim}-dimensional vectors" if self.dim else "vectors of its own width"
            raise RequestError(400, f"`dimensions` is {dimensions!r}: this model answers {width} and never shortens "
                                    f"them; drop `dimensions`" + (f" or send {self.dim}" if self.dim else ""))
        encoding = doc.get("encoding_format")
        encoding = "float" if encoding is None else encoding
        if encoding not in ("float", "base64"):
            raise RequestError(400, f'"encoding_format" is {encoding!r}: use "float" (JSON numbers, '
                                    f'the default) or "base64" (little-endian float32, base64)')
        return Options(self._prompt(name), truncate, direction.lower(), normalize, encoding)

    def _prompt(self, name=None) -> str:
        name = name if name is not None else self.default_prompt
        return self.prompts.get(name, "") if name is not None else ""

    def _encode(self, text: str, prompt: str = "", truncate: bool = False, what: str = "the text",
                direction: str = "right") -> dict:
        # sentence-transformers prepends the prompt to the text before tokenizing.
        enc = (self.truncating[direction] if truncate else self.tokenizer).encode(prompt + text)
        if len(enc.ids) > self.max_length:
            raise RequestError(413, f"{what} is {len(enc.ids)} tokens{' with its prompt' if prompt else ''}, over the "
                                    f"model's limit of {self.max_length}; send \"truncate\": true to cut it "
                                    f"(as sentence-transformers does) or split it")
        row = {"input_ids": np.asarray(enc.ids, dtype=np.int64),
               "attention_mask": np.asarray(enc.attention_mask, dtype=np.int64)}
        if not self.include_prompt:
            row["pooling_mask"] = row["attention_mask"].copy()
            row["pooling_mask"][:self.prompt_length(prompt)] = 0
        return row

    def prompt_length(self, prompt: str) -> int:
        """The prompt's tokens at the start of a row, as sentence-transformers counts them for
        include_prompt false: the prompt tokenized alone, less a trailing special token (none: 0)."""
        if not prompt:
            return 0
        if prompt not in self.prompt_lengths:
            enc = self.tokenizer.encode(prompt)
            n = len(enc.ids)
            if n and enc.special_tokens_mask[-1]:
                n -= 1
            self.prompt_lengths[prompt] = n
        return self.prompt_lengths[prompt]

    def _decode(self, body, media):
        options = Options(self._prompt())
        if media in JSON_TYPES or isinstance(body, (dict, list)):
            doc = _parse_json(body)
            if isinstance(doc, dict):
                check_keys(doc, REQUEST_KEYS, "the request", self.usage())
                if "text" in doc and "inputs" in doc:
                    raise RequestError(400, 'the request has both `text` and `inputs`: send {"text": "..."} '
                                            '(answers {"embedding": [...]}) or {"inputs": "..." | [...]} (answers '
                                            'a list of embeddings), not both')
                text = doc.get("text", doc.get("inputs"))
                options = self._options(doc)
            else:
                text = doc if isinstance(doc, str) else None
            if not isinstance(text, str):
                raise RequestError(400, f'JSON body must be {{"text": "<a string>"}}; got '
                                        f"{type(doc).__name__} without a string `text`")
        elif media == "" or media.startswith("text/"):
            text = _text_of(body)
        else:
            raise RequestError(415, f"Content-Type {media!r} is not supported for text; {self.usage()}")
        if not text.strip():
            raise RequestError(400, f"text is empty; {self.usage()}")
        sample = self._encode(text, options.prompt, options.truncate, direction=options.direction)
        if options.encoding != "float":
            sample["encoding_format"] = options.encoding
        if options.normalize is not None:
            sample["normalize"] = options.normalize
        return sample

    def collate(self, samples):
        if not samples:
            raise ValueError("collate needs at least one sample")
        longest = max(len(s["input_ids"]) for s in samples)
        feeds = {"input_ids": np.full((len(samples), longest), self.pad_id, dtype=np.int64)}
        for name in samples[0]:
            if name not in feeds and name.endswith("_mask"):
                feeds[name] = np.zeros((len(samples), longest), dtype=np.int64)
        for row, s in enumerate(samples):
            n = len(s["input_ids"])
            cols = slice(longest - n, longest) if self.left_padding else slice(0, n)
            for name, arr in feeds.items():
                arr[row, cols] = s[name]
        return feeds

    def vector(self, outputs, i, normalize=None) -> np.ndarray:
        """Row i's vector in fp32; unit length when the model's modules normalise or `normalize` asks it."""
        vector = np.ascontiguousarray(outputs[0][i], dtype=np.float32)
        if self.normalize or normalize:
            # The model ends with Normalize: a variant that ran it in half precision (ONNX fp16
            # converts the whole graph) is brought back to a unit vector in fp32.
            norm = float(np.linalg.norm(vector))
            if norm > 0.0:
                vector = vector / np.float32(norm)
        return vector

    def respond(self, outputs, i):
        return {"embedding": self.vector(outputs, i).tolist()}

    def respond_bytes(self, outputs, i, sample=None):
        sample = sample or {}
        vector = self.vector(outputs, i, sample.get("normalize"))
        if sample.get("encoding_format") == "base64":
            return json_bytes({"embedding": _b64(vector), "encoding_format": "base64"})
        return json_bytes({"embedding": vector})

    def example_feeds(self, batch_size, seq_len=None):
        # 16 tokens by default: a short sentence, enough to warm up (JIT, allocator) without
        # slowing worker start; benchmarks pass their own length.
        seq_len = int(seq_len or min(self.max_length, 16))
        ids = example_ids(self.tokenizer, batch_size, seq_len)
        feeds = {"input_ids": ids, "attention_mask": np.ones((batch_size, seq_len), dtype=np.int64)}
        if not self.include_prompt:
            feeds["pooling_mask"] = feeds["attention_mask"].copy()
        return feeds

    def example_requests(self, n, seed=0):
        rng = random.Random(seed)
        names = sorted(self.prompts)
        requests = []
        for k in range(n):
            # 5–15 words: the short-sentence traffic of the reference load (docs/handtuned.md); lengths vary,
            # so batches need padding. A query under each of the folder's prompts in turn (TEI's prompt_name).
            name = names[(k // 3) % len(names)] if names and k % 3 == 2 else None
            words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 15))]
            doc = self._fitting(words, self._prompt(name))
            if name is not None:
                requests.append((json.dumps({**doc, "prompt_name": name}).encode("utf-8"), "application/json"))
            elif k % 2 == 0 and "truncate" not in doc:
                requests.append((doc["text"].encode("utf-8"), "text/plain"))
            else:
                requests.append((json.dumps(doc).encode("utf-8"), "application/json"))
        return requests

    def _fitting(self, words: list, prompt: str) -> dict:
        """A sentence of `words` within the model's length (a small vocabulary spells words in many
        tokens): words dropped from the end until it fits, else the request asks to truncate."""
        while True:
            text = " ".join(words).capitalize() + "."
            if len(self.tokenizer.encode(prompt + text).ids) <= self.max_length:
                return {"text": text}
            if len(words) == 1:
                return {"text": text, "truncate": True}
            words = words[:-1]


def _b64(vector: np.ndarray) -> str:
    """OpenAI's compact form: the float32 values, little-endian, base64-encoded."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
