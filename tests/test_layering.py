"""The layers keep to their side: SQL only in orchestrator/db/, and workers never import the head."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def importers(package: str, prefix: str) -> list[str]:
    return sorted(str(path.relative_to(ROOT)) for path in (ROOT / package).rglob("*.py")
                  if any(m == prefix or m.startswith(prefix + ".") for m in imported_modules(path)))


def test_only_the_database_package_imports_sqlalchemy():
    outside = [p for p in importers("orchestrator", "sqlalchemy") if not p.startswith("orchestrator/db/")]
    assert outside == [] and importers("workers", "sqlalchemy") == []
    assert "orchestrator/db/repo.py" in importers("orchestrator", "sqlalchemy")  # the scan sees imports


def test_workers_never_import_the_orchestrator():
    assert importers("workers", "orchestrator") == []


def test_only_the_database_package_imports_optunas_sqlalchemy_models():
    outside = [p for p in importers("orchestrator", "optuna.storages._rdb") if not p.startswith("orchestrator/db/")]
    assert outside == [] and importers("workers", "optuna.storages._rdb") == []
    assert "orchestrator/db/storage.py" in importers("orchestrator", "optuna.storages._rdb")


PACKAGES = ("workers", "orchestrator", "migrations")
# Alembic's own pattern: its env.py imports the models it migrates (issue 21 allows this arrow)
ALLOWED_ARROWS = {("migrations.env", "orchestrator.db.models")}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path, modules: set[str]) -> set[str]:
    """The project's modules a file imports (``from workers import serve`` names workers.serve)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in out if name in modules}


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    modules = set(files)
    return {name: {m for m in project_imports(path, modules) if m != name and (name, m) not in ALLOWED_ARROWS}
            for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm): an import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_there_is_no_import_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the scan sees one
    graph = import_graph()
    assert "workers.labels" in graph["workers.join"] and "workers.serve" in graph["workers.agent"]
    assert cycles(graph) == []


OBJECTIVE_NAMES = {"tg", "pp", "e2e"}
OBJECTIVE_WORDS = ("objective", "obj", "target")


def objective_name_comparisons(source: str) -> list[str]:
    """Comparisons of an objective with a name ("e2e" anywhere; "tg"/"pp", which also name the
    measured rates, where the other side is an objective): the branches issue 21 item 3 removed."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        names = set()
        for side in sides:
            elts = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
            names |= {e.value for e in elts if isinstance(e, ast.Constant) and e.value in OBJECTIVE_NAMES}
        others = " ".join(ast.unparse(s) for s in sides if not isinstance(s, ast.Constant | ast.Tuple | ast.List
                                                                            | ast.Set)).lower()
        if "e2e" in names or (names and any(word in others for word in OBJECTIVE_WORDS)):
            found.append(ast.unparse(node))
    return found


def test_no_module_outside_the_objectives_compares_objective_names():
    old = ('a = obj.name == "e2e"\nb = t.study.objective == "tg"\nc = objective != "e2e"\n'
           'd = self.objective in ("tg", "pp", "e2e")\ne = target.name == "pp"\nf = kind == "pp"\n')
    assert len(objective_name_comparisons(old)) == 5  # the scan sees the old code's forms, not a rate's kind
    found = {str(p.relative_to(ROOT)): hits for package in ("workers", "orchestrator")
             for p in (ROOT / package).rglob("*.py") if p.name != "objective.py"
             and (hits := objective_name_comparisons(p.read_text()))}
    assert found == {}


def test_files_are_replaced_only_through_the_one_atomic_write():
    # workers/files.py: atomic_write and atomic_output; agent.py: a pushed model's temp file lives
    # across Ray calls; models.py: the GGUF writer names its own output (both via files.part_path or mkstemp);
    # llamatools.py: a built tools folder (not a file) is renamed into the cache whole
    allowed = {"workers/files.py", "workers/agent.py", "workers/models.py", "workers/llamatools.py"}
    users = {str(p.relative_to(ROOT)) for package in ("workers", "orchestrator") for p in (ROOT / package).rglob("*.py")
             if "os.replace(" in p.read_text() or "mkstemp(" in p.read_text() or ".rename(" in p.read_text()}
    assert users <= allowed, users - allowed


def test_the_head_validates_parameters_without_the_measuring_module():
    """Parameters are checked by the knob table (workers/knobs.py, a leaf); only the `bench` command,
    which measures on this machine, imports workers/bench.py."""
    assert importers("orchestrator", "workers.bench") == ["orchestrator/cli.py"]
    assert imported_modules(ROOT / "workers" / "knobs.py") <= {"__future__", "collections.abc", "dataclasses",
                                                               "os", "workers.errors"}
    assert "workers.knobs" in imported_modules(ROOT / "orchestrator" / "studies.py")
