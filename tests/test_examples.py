"""The worked examples under examples/ cannot rot: every params file validates as the pipeline
validates it; each text example says (README, params.yaml, Makefile) how its model is made, and a
missing model gets an error naming that command; every request a README shows is accepted by the
task's adapter and answered — by the example's model, built with the README's own command, through
the handler's adapter — exactly as the README shows (labels, order, indices, entity words and
offsets; scores within 1e-4). tests/serve/test_examples_served.py asks a real TorchServe the same."""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from pipeline.core.params import ParamsError, load_params, parse_params

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = REPO_ROOT / "examples"
TEXT_TASKS = ("text-classification", "rerank", "token-classification")    # scripts/make_text_task_model.py
FAMILIES = ("decoder-embedding", "decoder-rerank", "modernbert-embedding")  # their own scripts/make_*.py
BUILT = TEXT_TASKS + FAMILIES                                               # built by `make examples`
MAKE_MODEL = re.compile(r"python (scripts/make_\w+\.py) ((?:--\S+ \S+ ?)+)")
FENCE = re.compile(r"^```(\S*)\s*$")
SCORE_ATOL = 1e-4


@dataclass
class Case:
    """One curl of a README: the body it sends and the answer block shown after it."""
    body: bytes
    content_type: str
    model_name: str
    answer_lang: str
    answer: str


def code_blocks(text: str) -> list[tuple[str, str]]:
    blocks, lang, lines = [], None, []
    for line in text.splitlines():
        m = FENCE.match(line.strip())
        if m and lang is None:
            lang, lines = m.group(1) or "", []
        elif line.strip() == "```" and lang is not None:
            blocks.append((lang, "\n".join(lines)))
            lang = None
        elif lang is not None:
            lines.append(line)
    return blocks


def curl_cases(readme: Path) -> list[Case]:
    """Each fenced block holding a `curl ... -d '<body>'`, with the block right after it as its answer."""
    blocks = code_blocks(readme.read_text(encoding="utf-8"))
    cases = []
    for k, (lang, code) in enumerate(blocks):
        if "curl " not in code:
            continue
        body = re.search(r"-d '([^']*)'", code)
        ctype = re.search(r"-H 'Content-Type: ([^']+)'", code)
        name = re.search(r"/predictions/([\w.-]+)", code)
        assert body and ctype and name, f"{readme}: a curl without -d '<body>', a Content-Type or a model URL:\n{code}"
        assert k + 1 < len(blocks), f"{readme}: the curl sending {body.group(1)[:60]!r} shows no answer after it"
        cases.append(Case(body.group(1).encode("utf-8"), ctype.group(1), name.group(1), *blocks[k + 1]))
    return cases


def make_model_command(readme: Path, folder: str) -> tuple[str, list[str]]:
    """The README's command for this example's model: the script and its arguments."""
    found = [(m.group(1), shlex.split(m.group(2))) for m in MAKE_MODEL.finditer(readme.read_text(encoding="utf-8"))]
    assert found, f"{readme}: no `python scripts/make_*.py ...` command for the model"
    script, args = found[0]
    assert args[args.index("--out") + 1] == f"examples/{folder}/model", args
    if folder in TEXT_TASKS:
        assert script == "scripts/make_text_task_model.py" and args[args.index("--task") + 1] == folder, args
    return script, args


def example_params(task: str, checkpoint: Path | None = None):
    data = yaml.safe_load((EXAMPLES / task / "params.yaml").read_text())
    if checkpoint is not None:
        data["model"]["checkpoint"] = str(checkpoint)
    return parse_params(data)


def build_example_model(folder: str, out: Path) -> Path:
    """The example's model, made by the README's own command with only --out moved to `out`."""
    import importlib
    script, args = make_model_command(EXAMPLES / folder / "README.md", folder)
    args[args.index("--out") + 1] = str(out)
    assert importlib.import_module(script[:-3].replace("/", ".")).main(args) == 0
    return out


def answered(loaded, adapter, case: Case):
    """What the serving handler does with one request (decode → rows → model → respond), in-process."""
    import torch
    decoded = adapter.decode_request(case.body, case.content_type)     # RequestError if the README's body is bad
    with torch.no_grad():
        out = loaded.module(*loaded.example_inputs(adapter.collate(decoded.rows))).numpy()
    return json.loads(json.dumps(adapter.respond_request([[row] for row in out], decoded.meta)))


def differences(got, want, path: str = "answer") -> list[str]:
    """Every key and value equal except `score` (within SCORE_ATOL)."""
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return [f"{path}: {got!r} vs {want!r}"]
        return [d for k, (g, w) in enumerate(zip(got, want)) for d in differences(g, w, f"{path}[{k}]")]
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{path}: keys {sorted(got) if isinstance(got, dict) else got!r} vs {sorted(want)}"]
        out = []
        for key, w in want.items():
            if key == "score":
                if abs(float(got[key]) - float(w)) > SCORE_ATOL:
                    out.append(f"{path}.score: {got[key]} vs {w}")
            else:
                out += differences(got[key], w, f"{path}.{key}")
        return out
    return [] if got == want else [f"{path}: {got!r} vs {want!r}"]


# --------------------------------------------------------------------------- params files
@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*/params.yaml")), ids=lambda p: p.parent.name)
def test_every_example_params_file_validates(path):
    params = load_params(path)
    assert params.model.name and params.model.task
    if path.parent.name in BUILT:
        assert params.model.checkpoint == f"examples/{path.parent.name}/model"
    if path.parent.name in TEXT_TASKS:
        assert params.model.task == path.parent.name


def test_every_example_folder_has_a_row_and_a_guide():
    table = (EXAMPLES / "README.md").read_text(encoding="utf-8")
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    for folder in sorted(p for p in EXAMPLES.iterdir() if p.is_dir()):
        assert f"`{folder.name}/`" in table, f"examples/README.md has no row for {folder.name}/"
    for folder in (*BUILT, "text-embedding"):
        assert (EXAMPLES / folder / "README.md").is_file()
        assert f"(examples/{folder}/README.md)" in readme, f"README.md links no example for {folder}"


def test_example_readmes_links_resolve():
    from tests.test_docs import EXTERNAL, _links
    broken = []
    for readme in sorted(EXAMPLES.rglob("README.md")):
        for target in _links(readme):
            if EXTERNAL.match(target) or target.startswith("#"):
                continue
            if not (readme.parent / target.split("#")[0]).exists():
                broken.append(f"{readme.relative_to(REPO_ROOT)} -> {target}")
    assert not broken, broken


# --------------------------------------------------------------------------- making the models
@pytest.mark.parametrize("folder", BUILT)
def test_text_examples_say_how_their_model_is_made(folder):
    script, args = make_model_command(EXAMPLES / folder / "README.md", folder)
    command = f"python {script} {' '.join(args)}"
    header = (EXAMPLES / folder / "params.yaml").read_text()
    assert command in header and "make examples" in header
    makefile = (REPO_ROOT / "Makefile").read_text()
    if folder in TEXT_TASKS:
        tasks = re.search(r"^EXAMPLE_TASKS\s*:=\s*(.+)$", makefile, re.MULTILINE)
        assert tasks and folder in tasks.group(1).split(), "make examples does not build this example's model"
    else:
        assert f"$(BIN)/{command}" in makefile, "make examples does not build this example's model"
    assert re.search(r"^examples:", makefile, re.MULTILINE)
    assert "/examples/*/model/" in (REPO_ROOT / ".gitignore").read_text().splitlines()


def test_a_missing_example_model_names_the_command_that_makes_it(tmp_path):
    from pipeline.model.checkpoint import CheckpointError, load_model
    params = example_params("rerank", checkpoint=EXAMPLES / "rerank" / "not-built-model")
    with pytest.raises(CheckpointError) as e:
        load_model(params)
    assert "make examples" in str(e.value)
    assert "python scripts/make_text_task_model.py --task rerank --out examples/rerank/model" in str(e.value)
    # elsewhere the message stays the general one
    with pytest.raises(CheckpointError, match="relative to the repo root"):
        load_model(example_params("rerank", checkpoint=tmp_path / "nothing"))


def test_an_example_params_file_with_a_bad_key_is_refused(tmp_path):
    data = yaml.safe_load((EXAMPLES / "rerank" / "params.yaml").read_text())
    data["model"]["text"]["max_txts"] = 3
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ParamsError, match="max_txts"):
        load_params(path)


# --------------------------------------------------------------------------- the requests and answers shown
@pytest.fixture(scope="module")
def example_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("example_models")
    return {folder: build_example_model(folder, root / folder) for folder in BUILT}


def figures(vectors: list) -> tuple:
    """What an embedding README's one-liner prints: the count, the size, the first's cosine with each."""
    return len(vectors), len(vectors[0]), [sum(a * b for a, b in zip(vectors[0], v)) for v in vectors]


def shown_figures(text: str) -> tuple:
    count, size, cosines = text.strip().split(" ", 2)
    return int(count), int(size), json.loads(cosines)


@pytest.mark.parametrize("folder", BUILT)
def test_readme_requests_are_answered_as_shown(folder, example_models):
    from handlers.tasks import make_adapter
    from pipeline.model.checkpoint import load_model
    params = example_params(folder, checkpoint=example_models[folder])
    loaded = load_model(params)
    adapter = make_adapter(example_models[folder], loaded.task)
    cases = curl_cases(EXAMPLES / folder / "README.md")
    assert len(cases) >= (1 if folder == "modernbert-embedding" else 2), "the example shows its requests"
    for case in cases:
        assert case.model_name == params.model.name, "the curl asks another model than params.yaml names"
        got = answered(loaded, adapter, case)
        if params.model.task == "text-embedding":
            assert case.answer_lang == "text", f"the figures after {case.body[:60]!r} are not a ```text block"
            (n, size, cosines), (want_n, want_size, want) = figures(got), shown_figures(case.answer)
            assert (n, size) == (want_n, want_size) and max(abs(c - w) for c, w in zip(cosines, want)) < 2e-4, got
            continue
        assert case.answer_lang == "json", f"the answer to {case.body[:60]!r} is not a ```json block"
        want = json.loads(case.answer)
        assert differences(got, want) == [], (case.body, got)


@pytest.mark.slow
def test_text_embedding_readme_list_request_is_answered_as_shown():
    """The repo's MiniLM (params.yaml): the README's figures are what its list request gets."""
    from handlers.tasks import make_adapter
    from pipeline.core.params import checkpoint_path
    from pipeline.model.checkpoint import load_model
    params = load_params(REPO_ROOT / "params.yaml")
    assert params.model.task == "text-embedding"
    loaded = load_model(params)
    adapter = make_adapter(checkpoint_path(params), loaded.task)
    (case,) = curl_cases(EXAMPLES / "text-embedding" / "README.md")
    assert case.model_name == params.model.name and json.loads(case.body)["inputs"]
    vectors = answered(loaded, adapter, case)
    figures = f"{len(vectors)} {len(vectors[0])} {[round(sum(a * b for a, b in zip(vectors[0], v)), 4) for v in vectors]}"
    assert case.answer_lang == "text" and case.answer.strip() == figures
