"""text-classification: a sequence-classification head over a text or a text pair.

Requests (the Hugging Face task spec, what `transformers.pipeline("text-classification")` takes):
- text/plain: one text;
- JSON `{"inputs": str | {"text", "text_pair"} | [str | {"text", "text_pair"}, ...],
  "parameters": {"top_k": int | null, "function_to_apply": "sigmoid" | "softmax" | "none"}}`.
Answers: `[{"label", "score"}, ...]` sorted by score, `top_k` entries (default 1, null = every
label); a list input gets one such list per input, and so does a JSON body whose `inputs` is one
string: `[[{"label", "score"}, ...]]`, the Hugging Face Inference API's answer, what
`huggingface_hub.InferenceClient.text_classification` POSTs (`{"inputs": "<text>", "parameters": {...}}`)
and parses. text/plain, a bare JSON string and a pair `{"inputs": {"text", "text_pair"}}` (also
`{"inputs": {"text": "<text>"}}`, one text with parameters) answer the flat list, as
`transformers.pipeline` does for one input. Labels are config.json's `id2label`. The score
function is chosen as transformers does: regression → none, multi-label or one label → sigmoid,
else softmax. A list input is one row per text (fanned out by the serving handler), capped at
`max_texts` per request (413). Pairs carry token_type_ids where the model takes them; a pair over
the limit loses tokens from its longer side first (longest_first), a single text from its end.
"""
from __future__ import annotations

import json
import random

import numpy as np

from handlers.tasks import (JSON_TYPES, Decoded, RequestError, _json_or_text, _media_type, check_count,
                            check_keys, check_text)
from handlers.tasks.text import TextTaskAdapter, parameters_of, positive_int, sigmoid, softmax

FUNCTIONS = ("sigmoid", "softmax", "none")
PARAMETERS = ("top_k", "function_to_apply")


def default_function(num_labels: int, problem_type: str | None) -> str:
    """transformers' TextClassificationPipeline.postprocess choice when the request names none."""
    if problem_type == "regression":
        return "none"
    if problem_type == "multi_label_classification" or num_labels == 1:
        return "sigmoid"
    return "softmax"


def scores_of(logits: np.ndarray, function: str) -> np.ndarray:
    logits = np.asarray(logits, dtype=np.float32)
    if function == "sigmoid":
        return sigmoid(logits)
    if function == "softmax":
        return softmax(logits)
    return logits


class TextClassificationAdapter(TextTaskAdapter):
    kind = "text-classification"
    truncation = "longest_first"

    def __init__(self, model_dir, task):
        super().__init__(model_dir, task)
        self.labels = [str(x) for x in self.task["labels"]]
        self.function = self.task.get("function") or default_function(len(self.labels), self.task.get("problem_type"))

    def usage(self) -> str:
        return ('send text/plain, or JSON {"inputs": "<text>" | {"text": "...", "text_pair": "..."} | [ ... ], '
                '"parameters": {"top_k": 1, "function_to_apply": "softmax"}} with Content-Type application/json '
                '(a JSON string or list `inputs` answers one list of labels per text)')

    def decode_request(self, body, content_type=None):
        self.check_body(body)
        media = _media_type(content_type)
        doc = _json_or_text(body, media, self.usage())
        params = {}
        if isinstance(doc, str) and media not in JSON_TYPES:
            inputs = doc
        elif isinstance(doc, dict):
            check_keys(doc, ("inputs", "parameters"), "the JSON body", self.usage())
            if "inputs" not in doc:
                raise RequestError(400, f"the JSON body has no `inputs`; {self.usage()}")
            inputs, params = doc["inputs"], parameters_of(doc, PARAMETERS, self.usage())
        else:
            inputs = doc            # a bare JSON string or list: the `inputs` alone
        single = not isinstance(inputs, list)
        # Hugging Face's body, {"inputs": "<text>"}: one list per input, as its Inference API answers.
        nested = single and isinstance(doc, dict) and isinstance(inputs, str)
        items = [inputs] if single else inputs
        if not items:
            raise RequestError(400, f"`inputs` is an empty list; {self.usage()}")
        check_count(len(items), self.max_texts)
        rows = [self.row_of(self.encode(*self._pair(item, "inputs" if single else f"inputs[{i}]")))
                for i, item in enumerate(items)]
        top_k = positive_int(params["top_k"], "parameters.top_k", allow_none=True) if "top_k" in params else 1
        function = params.get("function_to_apply", self.function)
        if function not in FUNCTIONS:
            raise RequestError(400, f"parameters.function_to_apply = {function!r}: allowed {', '.join(FUNCTIONS)}")
        return Decoded(rows, {"single": single and not nested, "top_k": top_k, "function": function})

    def _pair(self, item, what: str) -> tuple:
        if isinstance(item, dict):
            check_keys(item, ("text", "text_pair"), what, self.usage())
            text = check_text(item.get("text"), f"{what}.text", self.usage())
            pair = item.get("text_pair")
            return (text,) if pair is None else (text, check_text(pair, f"{what}.text_pair", self.usage()))
        return (check_text(item, what, self.usage()),)

    def answer(self, logits: np.ndarray, top_k, function: str) -> list[dict]:
        scores = scores_of(logits, function)
        order = np.argsort(-scores, kind="stable")
        if top_k is not None:
            order = order[:top_k]
        return [{"label": self.labels[int(c)], "score": float(scores[c])} for c in order]

    def respond_request(self, row_outputs, meta):
        answers = [self.answer(r[0], meta["top_k"], meta["function"]) for r in row_outputs]
        return answers[0] if meta["single"] else answers

    def respond(self, outputs, i):
        return self.answer(outputs[0][i], 1, self.function)

    def example_requests(self, n, seed=0):
        rng = random.Random(seed)
        requests = []
        for k in range(n):
            if k % 3 == 0:
                requests.append((self.sentence(rng).encode("utf-8"), "text/plain"))
            elif k % 3 == 1:
                doc = {"inputs": self.sentence(rng), "parameters": {"top_k": None}}
                requests.append((json.dumps(doc).encode("utf-8"), "application/json"))
            else:
                doc = {"inputs": {"text": self.sentence(rng), "text_pair": self.sentence(rng)},
                       "parameters": {"top_k": None}}
                requests.append((json.dumps(doc).encode("utf-8"), "application/json"))
        return requests
