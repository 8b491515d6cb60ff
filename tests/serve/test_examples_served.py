"""The text examples' README requests in a REAL TorchServe 0.12: each example's model, built by its
README's command, goes through the pipeline's own steps (golden set, verified eager variant, .mar
with the torch handler); every request its README shows gets the answer the README shows (labels,
order, indices, entity words and offsets exactly; scores within 1e-4)."""
from __future__ import annotations

import json
import shutil

import pytest

from tests.serve.test_text_tasks_served import serve_task
from tests.test_examples import EXAMPLES, TEXT_TASKS, build_example_model, curl_cases, differences

pytestmark = [pytest.mark.torchserve,
              pytest.mark.skipif(shutil.which("java") is None, reason="TorchServe needs Java 17 (make java)")]


@pytest.mark.parametrize("task", TEXT_TASKS)
def test_example_readme_answers_are_what_torchserve_answers(tmp_path, task):
    folder = build_example_model(task, tmp_path / "model")
    ts, _ = serve_task(tmp_path, task, folder)
    cases = curl_cases(EXAMPLES / task / "README.md")
    with ts:
        for case in cases:
            response = ts.api.predict(case.body, case.content_type)
            served = response.json()
            print(f"{task}: {case.body.decode()}\n  -> {json.dumps(served)}")
            assert response.status == 200, served
            assert differences(served, json.loads(case.answer)) == [], (case.body, served)
