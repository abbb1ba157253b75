"""The floors of the code hold: a part imports only from floors below it (imports inside
functions included), run and doctor do not import each other's way up, and the planner
stays free of torch so that it answers instantly."""

from __future__ import annotations

import ast
from pathlib import Path

import trainwise

FLOORS = {
    "cli": 5, "report": 4, "run": 3, "doctor": 3, "plan": 2,
    "config": 1, "hardware": 1, "models": 1, "data": 1,
}
PACKAGE = Path(trainwise.__file__).parent


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def upward_imports(path: Path, part: str, label: str) -> list[str]:
    """Imports of `path` (a module of the folder `part`, shown as `label`) that break the
    floors."""
    wrong = []
    for line, module in imported_modules(path):
        names = module.split(".")
        where = f"{label}:{line}: {part} imports {module}"
        if part == "plan" and names[0] == "torch":
            wrong.append(where + " (the planner stays torch-free)")
        if names[0] != "trainwise" or len(names) < 2 or names[1] not in FLOORS:
            continue
        target = names[1]
        if FLOORS[target] > FLOORS[part] or (part == "run" and target == "doctor"):
            wrong.append(where)
    return wrong


def test_every_module_imports_only_from_lower_floors():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        if len(parts) > 1 and parts[0] in FLOORS:
            wrong += upward_imports(path, parts[0], "/".join(parts))
    assert wrong == []


def test_the_check_catches_an_upward_import(tmp_path: Path):
    """The test can fail: an import of the CLI from run/, even inside a function."""
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\n\ndef f():\n    import trainwise.cli.main\n")
    assert upward_imports(probe, "run", "run/probe.py") == [
        "run/probe.py:4: run imports trainwise.cli.main"
    ]
    assert upward_imports(probe, "plan", "plan/probe.py") == [
        "plan/probe.py:1: plan imports torch (the planner stays torch-free)",
        "plan/probe.py:4: plan imports trainwise.cli.main",
    ]
