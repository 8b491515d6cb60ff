"""rerank: a cross-encoder (a sequence classifier with ONE logit) scoring (query, text) pairs.

Requests (text-embeddings-inference `/rerank`): JSON `{"query": str, "texts": [str, ...],
"raw_scores": false, "return_text": false, "top_n": null}` (`documents` is accepted for `texts`,
the Cohere spelling; TEI's `truncate`/`truncation_direction` are accepted and ignored: the document
side is always the one truncated). Answers `[{"index", "score", "text"?}, ...]` sorted by score,
highest first (ties keep request order); score = sigmoid(logit) unless `raw_scores`.

One request becomes one model row per text: the serving handler fans them out over model calls
and gathers them back; more than `max_texts` texts in one request answers 413 naming the cap.
"""
from __future__ import annotations

import json
import random

import numpy as np

from handlers.tasks import (Decoded, RequestError, _json_or_text, _media_type, check_count, check_keys,
                            check_text)
from handlers.tasks.text import TextTaskAdapter, positive_int, sigmoid

KEYS = ("query", "texts", "documents", "raw_scores", "return_text", "top_n", "truncate", "truncation_direction")


class RerankAdapter(TextTaskAdapter):
    kind = "rerank"
    truncation = "only_second"      # keep the query whole, cut the document

    def usage(self) -> str:
        return ('send JSON {"query": "...", "texts": ["...", ...], "raw_scores": false, "return_text": false, '
                f'"top_n": null}} with Content-Type application/json (at most {self.max_texts} texts)')

    def decode_request(self, body, content_type=None):
        self.check_body(body)
        doc = _json_or_text(body, _media_type(content_type), self.usage())
        if not isinstance(doc, dict):
            raise RequestError(400, f"the body must be a JSON object, got {type(doc).__name__}; {self.usage()}")
        check_keys(doc, KEYS, "the JSON body", self.usage())
        if "query" not in doc:
            raise RequestError(400, f"`query` is missing; {self.usage()}")
        query = check_text(doc["query"], "query", self.usage())
        texts = doc.get("texts", doc.get("documents"))
        if texts is None:
            raise RequestError(400, f"`texts` is missing; {self.usage()}")
        if not isinstance(texts, list):
            raise RequestError(400, f"`texts` must be a list of strings, got {type(texts).__name__}; {self.usage()}")
        if not texts:
            raise RequestError(400, f"`texts` is an empty list; {self.usage()}")
        check_count(len(texts), self.max_texts)
        texts = [check_text(t, f"texts[{i}]", self.usage()) for i, t in enumerate(texts)]
        flags = {}
        for key in ("raw_scores", "return_text"):
            flags[key] = doc.get(key) or False
            if not isinstance(flags[key], bool):
                raise RequestError(400, f"`{key}` = {doc[key]!r}: needs true or false")
        top_n = positive_int(doc.get("top_n"), "top_n", allow_none=True)
        rows = [self.row_of(self.encode(query, t)) for t in texts]
        return Decoded(rows, {**flags, "top_n": top_n, "texts": texts if flags["return_text"] else None})

    def respond_request(self, row_outputs, meta):
        logits = np.asarray([np.asarray(r[0], dtype=np.float32).reshape(-1)[0] for r in row_outputs])
        scores = logits if meta["raw_scores"] else sigmoid(logits)
        order = np.argsort(-scores, kind="stable")
        if meta["top_n"] is not None:
            order = order[:meta["top_n"]]
        answer = []
        for i in order:
            item = {"index": int(i), "score": float(scores[i])}
            if meta["texts"] is not None:
                item["text"] = meta["texts"][i]
            answer.append(item)
        return answer

    def respond(self, outputs, i):
        return [{"index": 0, "score": float(sigmoid(np.asarray(outputs[0][i], dtype=np.float32).reshape(-1)[0]))}]

    # The expected rerank load (issue 26): retrieval's top hits for one query, as cross-encoders are used.
    TEXTS_PER_QUERY = (10, 50)      # candidate passages per request
    QUERY_WORDS = (5, 15)           # a search query
    PASSAGE_WORDS = (30, 80)        # a retrieved passage: the pair, not the query, sets the row's length

    def queries(self, n: int, seed: int = 0, texts: int | None = None) -> list[tuple[str, list[str]]]:
        """`n` deterministic (query, passages) pairs: TEXTS_PER_QUERY passages each (at most
        max_texts), or exactly `texts` when given."""
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            count = texts if texts is not None else rng.randint(*self.TEXTS_PER_QUERY)
            out.append((self.sentence(rng, *self.QUERY_WORDS),
                        [self.sentence(rng, *self.PASSAGE_WORDS) for _ in range(min(self.max_texts, count))]))
        return out

    def example_requests(self, n, seed=0, texts: int | None = None):
        return [(json.dumps({"query": q, "texts": t}).encode("utf-8"), "application/json")
                for q, t in self.queries(n, seed, texts)]

    def example_feeds(self, batch_size, seq_len=None):
        """With `seq_len`: synthetic rows of that length. Without (warm-up, benchmarks): the first
        `batch_size` rows of the example requests, (query, passage) pairs tokenized and padded to the
        batch's longest as the handler does, so the offline curve is measured on rows shaped like the
        served ones (a pair of ~50-110 tokens, not a 16-token sentence)."""
        if seq_len:
            return super().example_feeds(batch_size, seq_len)
        per_request = max(1, min(self.TEXTS_PER_QUERY[0], self.max_texts))
        rows = [self.row_of(self.encode(query, t))
                for query, texts in self.queries(-(-batch_size // per_request)) for t in texts]
        return self.collate(rows[:batch_size])
