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


def test_the_head_validates_parameters_without_the_measuring_module():
    """Parameters are checked by the knob table (workers/knobs.py, a leaf); only the `bench` command,
    which measures on this machine, imports workers/bench.py."""
    assert importers("orchestrator", "workers.bench") == ["orchestrator/cli.py"]
    assert imported_modules(ROOT / "workers" / "knobs.py") <= {"__future__", "collections.abc", "dataclasses",
                                                               "os", "workers.errors"}
    assert "workers.knobs" in imported_modules(ROOT / "orchestrator" / "studies.py")
