"""token-classification (NER): one label per token, grouped into entities with character offsets.

Requests (the Hugging Face task spec): text/plain, or JSON `{"inputs": str | [str, ...],
"parameters": {"aggregation_strategy": "none" | "simple" | "first" | "average" | "max",
"ignore_labels": ["O"]}}`. Answers, as `transformers.pipeline("token-classification")` gives them:
`[{"entity_group", "score", "word", "start", "end"}, ...]`, or with aggregation "none"
`[{"entity", "score", "index", "word", "start", "end"}, ...]`; a list input gets one list per text.
start/end are character offsets into the text (the fast tokenizer's offsets); `word` is the
tokenizer's decoding of the entity's tokens, as transformers decodes them. That flat list for one
text is also the Hugging Face Inference API's answer, what `huggingface_hub.InferenceClient
.token_classification` parses; its `stride` parameter (the overlap of the chunks a long text is cut
into) is accepted and changes nothing: a text is never cut here, so there are no chunks.

Over-long text: REFUSED with 413 naming the token count and the limit — never cut. transformers'
pipeline truncates silently at model_max_length and loses the entities of the tail; a client that
wants long documents splits them (e.g. by sentence) and sends a list, one row per text.
The aggregation is a port of transformers' TokenClassificationPipeline (gather_pre_entities,
aggregate, aggregate_words, group_entities) over numpy, so answers match it word for word.
"""
from __future__ import annotations

import json
import random

import numpy as np

from handlers.tasks import JSON_TYPES, Decoded, RequestError, _json_or_text, _media_type, check_count, check_keys, check_text
from handlers.tasks.text import TextTaskAdapter, parameters_of, softmax

STRATEGIES = ("none", "simple", "first", "average", "max")
PARAMETERS = ("aggregation_strategy", "ignore_labels", "stride")


class TokenClassificationAdapter(TextTaskAdapter):
    kind = "token-classification"
    truncation = None               # refuse, never cut (module doc)

    def __init__(self, model_dir, task):
        super().__init__(model_dir, task)
        self.labels = [str(x) for x in self.task["labels"]]
        self.default_strategy = self.task.get("aggregation_strategy", "simple")
        # Token scores are read from each row's start: right padding whatever the folder says (a
        # bidirectional tagger's answers do not depend on the side).
        self.left_padding = False
        model = self.tokenizer.model
        self.subword_prefix = getattr(model, "continuing_subword_prefix", None)
        unk = getattr(model, "unk_token", None)
        self.unk_id = self.tokenizer.token_to_id(unk) if unk else None

    def usage(self) -> str:
        return ('send text/plain, or JSON {"inputs": "<text>", "parameters": {"aggregation_strategy": '
                f'"simple", "ignore_labels": ["O"]}}}} with Content-Type application/json; at most '
                f'{self.max_length} tokens per text')

    def decode_request(self, body, content_type=None):
        self.check_body(body)
        media = _media_type(content_type)
        doc = _json_or_text(body, media, self.usage())
        params = {}
        if isinstance(doc, dict):
            check_keys(doc, ("inputs", "parameters"), "the JSON body", self.usage())
            if "inputs" not in doc:
                raise RequestError(400, f"the JSON body has no `inputs`; {self.usage()}")
            inputs, params = doc["inputs"], parameters_of(doc, PARAMETERS, self.usage())
        else:
            inputs = doc
        single = not isinstance(inputs, list)
        texts = [inputs] if single else inputs
        if not texts:
            raise RequestError(400, f"`inputs` is an empty list; {self.usage()}")
        check_count(len(texts), self.max_texts)
        strategy = params.get("aggregation_strategy", self.default_strategy)
        if not isinstance(strategy, str) or strategy.lower() not in STRATEGIES:
            raise RequestError(400, f"parameters.aggregation_strategy = {strategy!r}: allowed {', '.join(STRATEGIES)}")
        ignore = params.get("ignore_labels", ["O"])
        if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
            raise RequestError(400, f"parameters.ignore_labels = {ignore!r}: needs a list of label strings")
        stride = params.get("stride")
        if stride is not None and (isinstance(stride, bool) or not isinstance(stride, int) or stride < 0):
            raise RequestError(400, f"parameters.stride = {stride!r}: needs an integer >= 0 (or leave it out)")
        if stride and strategy.lower() == "none":
            raise RequestError(400, "parameters.stride needs an aggregation_strategy other than \"none\" "
                                    "(as transformers' pipeline): send \"simple\", \"first\", \"average\" or \"max\"")
        rows, encodings = [], []
        for i, text in enumerate(texts):
            text = check_text(text, "inputs" if single else f"inputs[{i}]", self.usage())
            enc = self.encode(text)
            rows.append(self.row_of(enc))
            encodings.append((text, enc.ids, enc.offsets, enc.special_tokens_mask))
        return Decoded(rows, {"single": single, "strategy": strategy.lower(), "ignore": ignore,
                              "texts": encodings})

    # ------------------------------------------------------------------ transformers' postprocess
    def respond_request(self, row_outputs, meta):
        answers = []
        for r, (text, ids, offsets, special) in zip(row_outputs, meta["texts"]):
            scores = softmax(np.asarray(r[0], dtype=np.float32)[:len(ids)])
            pre = self.pre_entities(text, ids, scores, offsets, special, meta["strategy"])
            entities = self.aggregate(pre, meta["strategy"])
            answers.append([self._jsonable(e) for e in entities
                            if e.get("entity") not in meta["ignore"] and e.get("entity_group") not in meta["ignore"]])
        return answers[0] if meta["single"] else answers

    @staticmethod
    def _jsonable(entity: dict) -> dict:
        return {k: (float(v) if k == "score" else int(v) if k in ("start", "end", "index") else v)
                for k, v in entity.items()}

    def tokens_to_string(self, tokens: list[str]) -> str:
        decoder = self.tokenizer.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    def pre_entities(self, text, ids, scores, offsets, special, strategy) -> list[dict]:
        out = []
        for idx, token_scores in enumerate(scores):
            if special[idx]:
                continue
            word = self.tokenizer.id_to_token(int(ids[idx]))
            start, end = offsets[idx]
            word_ref = text[start:end]
            if self.subword_prefix:
                is_subword = len(word) != len(word_ref)
            else:
                is_subword = start > 0 and " " not in text[start - 1:start + 1]
            if self.unk_id is not None and int(ids[idx]) == self.unk_id:
                word, is_subword = word_ref, False
            out.append({"word": word, "scores": token_scores, "start": start, "end": end, "index": idx,
                        "is_subword": is_subword})
        return out

    def aggregate(self, pre: list[dict], strategy: str) -> list[dict]:
        if strategy in ("none", "simple"):
            entities = []
            for p in pre:
                c = int(p["scores"].argmax())
                entities.append({"entity": self.labels[c], "score": p["scores"][c], "index": p["index"],
                                 "word": p["word"], "start": p["start"], "end": p["end"]})
        else:
            entities = self.aggregate_words(pre, strategy)
        return entities if strategy == "none" else self.group_entities(entities)

    def aggregate_word(self, group: list[dict], strategy: str) -> dict:
        word = self.tokens_to_string([e["word"] for e in group])
        if strategy == "first":
            scores = group[0]["scores"]
        elif strategy == "max":
            scores = max(group, key=lambda e: e["scores"].max())["scores"]
        else:   # average
            scores = np.nanmean(np.stack([e["scores"] for e in group]), axis=0)
        c = int(scores.argmax())
        return {"entity": self.labels[c], "score": scores[c], "word": word,
                "start": group[0]["start"], "end": group[-1]["end"]}

    def aggregate_words(self, pre: list[dict], strategy: str) -> list[dict]:
        words, group = [], None
        for e in pre:
            if group is None:
                group = [e]
            elif e["is_subword"]:
                group.append(e)
            else:
                words.append(self.aggregate_word(group, strategy))
                group = [e]
        if group is not None:
            words.append(self.aggregate_word(group, strategy))
        return words

    @staticmethod
    def tag_of(name: str) -> tuple[str, str]:
        if name.startswith("B-"):
            return "B", name[2:]
        if name.startswith("I-"):
            return "I", name[2:]
        return "I", name

    def group_entities(self, entities: list[dict]) -> list[dict]:
        groups, current = [], []
        for e in entities:
            if not current:
                current.append(e)
                continue
            bi, tag = self.tag_of(e["entity"])
            _, last_tag = self.tag_of(current[-1]["entity"])
            if tag == last_tag and bi != "B":
                current.append(e)
            else:
                groups.append(self.group_sub(current))
                current = [e]
        if current:
            groups.append(self.group_sub(current))
        return groups

    def group_sub(self, entities: list[dict]) -> dict:
        return {"entity_group": entities[0]["entity"].split("-", 1)[-1],
                "score": np.mean(np.nanmean([e["score"] for e in entities])),
                "word": self.tokens_to_string([e["word"] for e in entities]),
                "start": entities[0]["start"], "end": entities[-1]["end"]}

    def respond(self, outputs, i):
        raise RequestError(500, "token-classification answers need the request's offsets: use respond_request")

    def example_requests(self, n, seed=0):
        rng = random.Random(seed)
        requests = []
        for k in range(n):
            text = self.sentence(rng, 4, 14)
            if k % 2 == 0:
                requests.append((text.encode("utf-8"), "text/plain"))
            else:
                doc = {"inputs": text, "parameters": {"aggregation_strategy": STRATEGIES[k % len(STRATEGIES)]}}
                requests.append((json.dumps(doc).encode("utf-8"), "application/json"))
        return requests
