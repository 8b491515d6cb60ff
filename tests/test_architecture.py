"""The library's shape: subpackages in layers that import only downward, no import cycles between
modules, handlers/ self-contained (it is packed into the .mar), no source file over 400 lines and no
folder over 12 modules (a folder that grows past that has a seam to split along)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# Bottom to top: a subpackage may import the ones before it, never one after it.
LAYERS = ["core", "host", "model", "accuracy", "build", "measure", "decide", "serve", "publish", "fleet"]
MAX_LINES = 400
MAX_MODULES = 12
CODE_TOPS = ("pipeline", "handlers", "stages", "scripts")


def _imports(path: Path, module_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else ast.walk(tree)
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def _module_of(path: Path) -> str:
    rel = path.relative_to(REPO_ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources(top: str) -> list[Path]:
    return sorted((REPO_ROOT / top).rglob("*.py"))


def test_pipeline_top_holds_only_subpackages():
    top = [p.name for p in (REPO_ROOT / "pipeline").glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= 3, f"modules left at pipeline/'s top: {top}"
    packages = sorted(p.name for p in (REPO_ROOT / "pipeline").iterdir()
                      if p.is_dir() and (p / "__init__.py").exists())
    assert packages == sorted(LAYERS), f"subpackages {packages} vs the layers declared here {LAYERS}"


def test_imports_only_run_downward():
    upward = []
    for path in _sources("pipeline"):
        rel = path.relative_to(REPO_ROOT / "pipeline").parts
        if len(rel) < 2:
            continue
        own = LAYERS.index(rel[0])
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "pipeline" and len(parts) > 1 and parts[1] in LAYERS and LAYERS.index(parts[1]) > own:
                upward.append(f"{path.relative_to(REPO_ROOT)} imports {name}")
    assert not upward, "imports running up the layers:\n" + "\n".join(upward)


def test_no_import_cycles_between_modules():
    """Module-level imports only: a function-level import is how a registry loads its members."""
    modules = {_module_of(p): p for top in ("pipeline", "handlers", "stages") for p in _sources(top)}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(path, module_level_only=True):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                targets.add(imported)
        graph[name] = targets

    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_handlers_import_nothing_from_the_pipeline():
    """handlers/ runs inside TorchServe from the unpacked .mar, where pipeline/ does not exist."""
    offending = [f"{p.relative_to(REPO_ROOT)}: {n}" for p in _sources("handlers") for n in _imports(p)
                 if n.split(".")[0] in ("pipeline", "stages")]
    assert not offending, offending


def test_no_source_file_over_the_limit():
    long = {str(p.relative_to(REPO_ROOT)): n for top in CODE_TOPS
            for p in _sources(top) if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them along their seams): {long}"


def test_no_folder_holds_more_modules_than_the_limit():
    crowded = {}
    for top in CODE_TOPS:
        for folder in [REPO_ROOT / top, *(p for p in (REPO_ROOT / top).rglob("*") if p.is_dir())]:
            n = len(list(folder.glob("*.py")))
            if n > MAX_MODULES and "__pycache__" not in folder.parts:
                crowded[str(folder.relative_to(REPO_ROOT))] = n
    assert not crowded, f"folders over {MAX_MODULES} modules (group them by concern in subpackages): {crowded}"


def test_archives_pack_every_handler_module_the_entry_handlers_import():
    """The .mar holds a fixed list of handlers/ modules: one the serving code imports but the list
    misses would only show as a worker dying in TorchServe."""
    from pipeline.serve.archive import BASELINE_HANDLER, BASELINE_MODULES, ENTRY_HANDLERS, SERVING_MODULES

    def closure(entry: str) -> set[str]:
        seen, todo = set(), [entry]
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            for imported in _imports(REPO_ROOT / "handlers" / name):
                parts = imported.split(".")
                if parts[0] != "handlers":
                    continue
                # a module, or a package (its __init__.py), and the packages it lies in
                for k in range(2, len(parts) + 1):
                    rel = "/".join(parts[1:k])
                    for candidate in (f"{rel}.py", f"{rel}/__init__.py"):
                        if (REPO_ROOT / "handlers" / candidate).is_file():
                            todo.append(candidate)
        return seen

    for entry in ENTRY_HANDLERS.values():
        missing = closure(entry) - set(SERVING_MODULES) - {entry}
        assert not missing, f"{entry} imports {sorted(missing)}, which SERVING_MODULES does not pack"
    missing = closure(BASELINE_HANDLER) - set(BASELINE_MODULES) - {BASELINE_HANDLER}
    assert not missing, f"{BASELINE_HANDLER} imports {sorted(missing)}, which BASELINE_MODULES does not pack"
