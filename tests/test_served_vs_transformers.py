"""scripts/served_vs_transformers.py (its harness: scripts/served_compare/), the served-vs-transformers
check run on models the tests never build (docs/results/2026-12-tasks.md), kept from rotting: its
requests, references and comparison run here on tiny models with the handler's adapters in-process
(seconds), the comparison is shown to catch what it must (a score off by more than 0.01, a swapped
order, a moved offset, a missing item) and to let a tie's order go; one run goes through a real
TorchServe (marked `torchserve`)."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from scripts import served_vs_transformers as svt
from scripts.served_compare import harness
from scripts.served_compare.cases import Case
from scripts.served_compare.judging import judge
from scripts.served_compare.summary import agreement, summarize, table
from tests.handlers.text_task_models import make_models

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def text_models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("svt_text"), seed=21)


def _run(tmp_path: Path, *argv: str) -> tuple[int, dict]:
    out = tmp_path / "summary.json"
    rc = svt.main([*argv, "--json-out", str(out), "--workdir", str(tmp_path / "work")])
    return rc, json.loads(out.read_text())


@pytest.mark.parametrize("task", ["text-classification", "token-classification", "rerank"])
def test_in_process_text_tasks_match_transformers(tmp_path, text_models, task):
    rc, summary = _run(tmp_path, str(text_models[task]), "--task", task, "--in-process", "--requests", "16",
                       "--max-length", "64")
    assert rc == 0 and summary["mismatches"] == [], summary["mismatches"]
    assert summary["requests"] == summary["matched"] == 16 and summary["max_score_diff"] < 1e-4
    assert len(summary["by_kind"]) >= 5                 # the request kinds all ran (strategies, pairs, top_n, ...)


def test_in_process_hf_image_model_matches_transformers(tmp_path):
    from scripts.make_image_task_model import build
    folder = build(tmp_path / "mobilenet", "mobilenet_v2", seed=3)
    rc, summary = _run(tmp_path, str(folder), "--task", "image-classification", "--in-process", "--requests", "8")
    assert rc == 0 and summary["matched"] == 8, summary["mismatches"]
    assert summary["reference"] == "transformers.pipeline('image-classification')"


class TinyConv(nn.Module):
    def __init__(self, classes: int = 7):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 5, stride=4)
        self.fc = nn.Linear(8, classes)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3))) * 20.0


def build_tiny_conv(classes: int = 7) -> nn.Module:
    return TinyConv(classes).eval()


@pytest.mark.parametrize("image", [{"resize_shortest_edge": 40, "crop_size": [32, 36], "resample": "bicubic",
                                    "mean": [120.0, 125.0, 130.0], "std": [60.0, 64.0, 70.0]},
                                   {"size": [30, 44], "rescale_factor": 0.00392156862745098,
                                    "mean": [0.5, 0.4, 0.3], "std": [0.2, 0.25, 0.3], "top_k": 3}])
def test_in_process_state_dict_image_model_matches_its_eager_forward(tmp_path, image):
    """No transformers pipeline for a factory model: the reference is its own forward on transformers'
    processor set to params model.image, both recipe forms (shortest edge + crop, a plain resize)."""
    from safetensors.torch import save_file
    torch.manual_seed(2)
    save_file(TinyConv().state_dict(), str(tmp_path / "w.safetensors"))
    params = {"model": {"name": "tiny-conv", "source": "state_dict", "checkpoint": str(tmp_path / "w.safetensors"),
                        "factory": "tests/test_served_vs_transformers.py:build_tiny_conv",
                        "task": "image-classification", "image": image}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    rc, summary = _run(tmp_path, "--params", str(tmp_path / "params.yaml"), "--in-process", "--requests", "8")
    assert rc == 0 and summary["matched"] == 8, summary["mismatches"]
    assert summary["reference"].startswith("the factory module's eager forward")


# --------------------------------------------------------------------------- the comparison itself
def _case(served, want, kind="k") -> Case:
    case = Case(kind, b"{}", "application/json", {})
    case.served, case.want = (200, served), want
    return judge(case)


RANKED = [{"label": "a", "score": 0.6}, {"label": "b", "score": 0.3}, {"label": "c", "score": 0.1}]
ENTITIES = [{"entity_group": "PER", "score": 0.9, "word": "john", "start": 0, "end": 4}]


def test_comparison_catches_every_kind_of_difference():
    assert _case(copy.deepcopy(RANKED), RANKED).problems == []
    close = copy.deepcopy(RANKED)
    close[0]["score"] += 0.009
    assert _case(close, RANKED).problems == [] and _case(close, RANKED).max_diff == pytest.approx(0.009)
    off = copy.deepcopy(RANKED)
    off[1]["score"] += 0.011
    assert "score" in _case(off, RANKED).problems[0]
    swapped = [RANKED[1], RANKED[0], RANKED[2]]
    assert "label" in _case(swapped, RANKED).problems[0] and _case(swapped, RANKED).ties == 0
    assert "items served" in _case(RANKED[:2], RANKED).problems[0]
    moved = [dict(ENTITIES[0], end=5)]
    assert _case(moved, ENTITIES).problems == ["item 0: end 5 vs 4"]
    assert _case([dict(ENTITIES[0], word="John")], ENTITIES).problems == ["item 0: word 'John' vs 'john'"]
    assert _case([dict(ENTITIES[0], entity="B-PER")], ENTITIES).problems       # an extra key
    assert _case([[dict(x) for x in RANKED]], [RANKED]).problems == []          # a list input's answers
    assert _case(off, RANKED).cause == "score off by more than 0.01"
    assert _case(swapped, RANKED).cause == "labels / order differ"
    assert _case(moved, ENTITIES).cause == "entities differ (label or span)"
    near = [{"index": 4, "score": 0.5}, {"index": 2, "score": 0.495}, {"index": 9, "score": 0.1}]
    assert _case([near[1], near[0], near[2]], near).cause == "order of items whose reference scores are within 0.01"
    chain = [{"index": 1, "score": 0.5}, {"index": 2, "score": 0.495}, {"index": 3, "score": 0.492},
             {"index": 4, "score": 0.1}]
    served = [dict(chain[2]), dict(chain[0]), dict(chain[1]), dict(chain[3])]
    assert _case(served, chain).cause.startswith("order of items whose reference scores are within")
    cut = Case("k", b"{}", "application/json", {"scores": {1: 0.5, 2: 0.3, 7: 0.295}})
    cut.served, cut.want = (200, [{"index": 1, "score": 0.5}, {"index": 7, "score": 0.3}]), chain[:1] + [
        {"index": 2, "score": 0.3}]
    assert judge(cut).cause.startswith("order of items")       # a near tie at the top_n cut
    assert "first difference at item 1" in _case([ENTITIES[0], dict(ENTITIES[0], start=5, end=9)], ENTITIES).problems[0]
    bad = Case("k", b"", "text/plain", {})
    bad.served, bad.want = (413, {"error": "too long"}), RANKED
    assert judge(bad).problems == ["HTTP 413: {'error': 'too long'}"]


def test_a_tie_may_come_in_either_order_but_nothing_else_moves():
    tied = [{"index": 4, "score": 0.5}, {"index": 2, "score": 0.5 + 5e-6}, {"index": 9, "score": 0.1}]
    served = [tied[1], tied[0], tied[2]]
    case = _case(served, tied)
    assert case.problems == [] and case.ties == 1
    far = [{"index": 4, "score": 0.5}, {"index": 2, "score": 0.49}, {"index": 9, "score": 0.1}]
    assert _case([far[1], far[0], far[2]], far).problems                         # 0.01 apart: not a tie
    summary = summarize([case, _case(RANKED[:1], RANKED, kind="other")])
    assert summary["ties"] == 1 and summary["matched"] == 1 and summary["mismatches"][0]["kind"] == "other"
    assert "| all" in table(summary)


def test_task_figures_beside_exactness():
    """Entity-level F1 (type and exact span) for NER, first-answer agreement for ranked answers."""
    other = [{"entity_group": "LOC", "score": 0.5, "word": "paris", "start": 14, "end": 19}]
    cases = [_case(ENTITIES + other, ENTITIES + other), _case([dict(ENTITIES[0], end=5)], ENTITIES)]
    assert agreement(cases) == {"entity_f1": pytest.approx(2 * 2 / (3 + 3), abs=1e-4)}
    ranked = [_case(RANKED, RANKED), _case([RANKED[1], RANKED[0]], RANKED[:2])]
    assert agreement(ranked) == {"first_answer_agreement": 0.5}


def test_the_script_exits_1_on_a_mismatch(tmp_path, text_models, monkeypatch):
    real = harness.in_process_post

    def off_by_a_bit(*a, **kw):
        post = real(*a, **kw)

        def shifted(body, ct):
            status, answer = post(body, ct)
            answer = copy.deepcopy(answer)
            answer[0]["score"] += 0.05
            return status, answer
        return shifted
    monkeypatch.setattr(harness, "in_process_post", off_by_a_bit)
    rc, summary = _run(tmp_path, str(text_models["rerank"]), "--task", "rerank", "--in-process", "--requests", "3")
    assert rc == 1 and len(summary["mismatches"]) == 3


# --------------------------------------------------------------------------- in a real TorchServe
@pytest.mark.torchserve
@pytest.mark.skipif(shutil.which("java") is None, reason="TorchServe needs Java 17 (make java)")
def test_served_rerank_matches_through_torchserve(tmp_path, text_models):
    rc, summary = _run(tmp_path, str(text_models["rerank"]), "--task", "rerank", "--requests", "8",
                       "--max-length", "64")
    assert rc == 0 and summary["matched"] == 8, summary["mismatches"]
    assert summary["served"].startswith("TorchServe") and summary["batches_formed"]
