"""The floors of the code hold: a part imports only from floors below it (imports inside
functions included), the top-level modules (errors, records, the tests' seam faults.py...)
sit below every floor, run and doctor do not import each other's way up, the planner stays
free of torch so that it answers instantly, run/'s wings import only from the wings below
them, and no folder grows past what a newcomer can scan.

api/ is the library's verbs (plan, train, report, doctor, export): they call report/, run/,
doctor/, export/ and plan/, and cli/ calls them, so it sits between cli and report. The package's face, __init__.py, re-exports it and nothing else
of the floors."""

from __future__ import annotations

import ast
from pathlib import Path

import trainwise

FLOORS = {
    "cli": 6, "api": 5, "report": 4, "run": 3, "doctor": 3, "export": 3, "plan": 2,
    "config": 1, "hardware": 1, "models": 1, "data": 1,
}
# run/'s wings, top to bottom.
WINGS = {"launch": 5, "engine": 4, "checkpoint": 3, "observe": 2, "job": 1}
ENTRY_POINTS = {"__main__.py"}  # `python -m trainwise` runs the CLI: the top of the house
FACE = "__init__.py"  # `import trainwise`: the API's names, re-exported
MAX_MODULES = 16
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
        if FLOORS[target] > FLOORS[part] or (part == "run" and target in ("doctor", "export")):
            wrong.append(where)
    return wrong


def upward_wing_imports(path: Path, wing: str, label: str) -> list[str]:
    """Imports of `path` (a module of run/'s `wing`) from a wing above it."""
    wrong = []
    for line, module in imported_modules(path):
        names = module.split(".")
        above = len(names) > 2 and names[2] in WINGS and WINGS[names[2]] > WINGS[wing]
        if names[:2] == ["trainwise", "run"] and above:
            wrong.append(f"{label}:{line}: run/{wing} imports {module}")
    return wrong


def test_every_module_imports_only_from_lower_floors():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        if len(parts) > 1 and parts[0] in FLOORS:
            wrong += upward_imports(path, parts[0], "/".join(parts))
        elif len(parts) == 1 and path.stem in FLOORS:  # a floor of one module
            wrong += upward_imports(path, path.stem, path.name)
    assert wrong == []


def test_the_api_sits_between_the_cli_and_the_report(tmp_path: Path):
    """The check can fail: the report (or anything below the API) calling the API, and
    the API calling the CLI."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from trainwise.api import train\n")
    assert upward_imports(probe, "report", "report/probe.py") == [
        "report/probe.py:2: report imports trainwise.api"
    ]
    assert upward_imports(probe, "cli", "cli/probe.py") == []
    probe.write_text("import trainwise.cli.main\n")
    assert upward_imports(probe, "api", "api/probe.py") == [
        "api/probe.py:1: api imports trainwise.cli.main"
    ]


def floor_imports(path: Path) -> list[str]:
    """Imports of a floor by `path`, a top-level module (below every floor)."""
    wrong = []
    for line, module in imported_modules(path):
        names = module.split(".")
        if names[0] == "trainwise" and len(names) > 1 and names[1] in FLOORS:
            wrong.append(f"{path.name}:{line}: imports {module}")
    return wrong


def test_top_level_modules_import_no_floor(tmp_path: Path):
    """errors.py, records.py, faults.py... are below every floor (data/ and run/ both use
    the tests' seam), so they import no part of trainwise's floors."""
    wrong = []
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name not in ENTRY_POINTS and path.name != FACE and path.stem not in FLOORS:
            wrong += floor_imports(path)
    assert wrong == []
    face = [line for line in floor_imports(PACKAGE / FACE) if not line.endswith("trainwise.api")]
    assert face == [], "__init__.py re-exports trainwise.api, and no other floor"
    probe = tmp_path / "probe.py"  # the check can fail: the seam reaching up to the planner
    probe.write_text("def f():\n    from trainwise.plan.model.comm import allreduce_factor\n")
    assert floor_imports(probe) == ["probe.py:2: imports trainwise.plan.model.comm"]


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


def test_run_wings_import_only_from_the_wings_below():
    wrong = []
    for path in sorted((PACKAGE / "run").rglob("*.py")):
        parts = path.relative_to(PACKAGE / "run").parts
        wing = parts[0].removesuffix(".py")
        if wing in WINGS:
            wrong += upward_wing_imports(path, wing, "run/" + "/".join(parts))
    assert wrong == []
    folders = {p.name for p in (PACKAGE / "run").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(WINGS), "a wing was added: give it its place in WINGS"


def test_the_wing_check_catches_an_upward_import(tmp_path: Path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from trainwise.run.engine.training import Training\n")
    assert upward_wing_imports(probe, "checkpoint", "run/checkpoint/probe.py") == [
        "run/checkpoint/probe.py:2: run/checkpoint imports trainwise.run.engine.training"
    ]
    assert upward_wing_imports(probe, "launch", "run/launch/probe.py") == []


def test_no_folder_holds_more_modules_than_a_newcomer_can_scan():
    crowded = {}
    for folder in [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir())]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > MAX_MODULES:
            crowded[str(folder.relative_to(PACKAGE.parent))] = len(modules)
    assert crowded == {}


# The commands that are the API's verbs; the others (export, launch, data, ...) have no
# API of their own yet and call their parts directly.
VERB_COMMANDS = ("plan.py", "train.py", "report.py", "doctor.py", "main.py")


def internals_imported(path: Path) -> list[str]:
    """Imports of trainwise.run or trainwise.plan (any depth) by `path`, a CLI module."""
    return [
        f"cli/{path.name}:{line}: imports {module}"
        for line, module in imported_modules(path)
        if module.split(".")[:2] in (["trainwise", "run"], ["trainwise", "plan"])
    ]


def test_the_verbs_commands_only_parse_call_the_api_and_print(tmp_path: Path):
    """cli/plan.py, train.py, report.py, doctor.py (and the dispatcher) import nothing from
    trainwise.run or trainwise.plan, at any depth, inside functions too: they parse their
    flags (trainwise.config), call trainwise.api and print with trainwise.report's
    renderers; the orchestration is the API's, shared with Python callers."""
    wrong = []
    for name in VERB_COMMANDS:
        wrong += internals_imported(PACKAGE / "cli" / name)
    assert wrong == []
    probe = tmp_path / "plan.py"  # the check can fail: a command reaching the planner
    probe.write_text("def run():\n    from trainwise.plan.planner import make_plan\n")
    assert internals_imported(probe) == ["cli/plan.py:2: imports trainwise.plan.planner"]
