"""The docs name only what exists: every file path (`src/...`, `tests/...`, a module
under the package such as `run/job/resolve.py`), every `file.py:name`, every
`trainwise.x.y` module or name and every `TRAINWISE_*` variable that README.md and
docs/*.md mention is there. A move or a
rename that leaves a doc behind fails here."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PACKAGE = ROOT / "src" / "trainwise"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Roots a path may start from: the repository's folders, then the package's own.
REPO_ROOTS = ("src", "tests", "bench", "examples", "docs")
PACKAGE_ROOTS = tuple(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__")
# `trainwise.` names that are not modules: MLflow tags, the profiler's step span.
NOT_MODULES = {"trainwise.events", "trainwise.last_event", "trainwise.step"}

_START = r"(?<![\w/.-])"  # not the tail of a longer path (RUN/..., another repository's)
REPO_PATH = re.compile(_START + rf"((?:{'|'.join(REPO_ROOTS)})/[\w./-]*\w)(?::(\w+))?")
PACKAGE_PATH = re.compile(_START + rf"((?:{'|'.join(PACKAGE_ROOTS)})/[\w/]*\.py)(?::(\w+))?")
BARE_FILE = re.compile(r"`(\w+\.py)(?::(\w+))?`")  # `resolve.py` in a sentence about run/job/
MODULE = re.compile(r"\btrainwise(?:\.\w+)+")
VARIABLE = re.compile(r"\bTRAINWISE_[A-Z_]+\b")
OTHER_REPOSITORY = re.compile(r"\b[\w-]+/[\w.-]+ `?$")  # "NVIDIA/nccl `src/...`": theirs


@cache
def defined_names(path: Path) -> frozenset[str]:
    """Top-level names of a module: functions, classes, assignments, imports (re-exports)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


@cache
def files_named(name: str) -> tuple[Path, ...]:
    return tuple(p for root in REPO_ROOTS for p in (ROOT / root).rglob(name))


def path_problems(text: str) -> list[str]:
    """What `text` names that does not exist, one line each."""
    wrong = []
    ours = [(ROOT, m) for m in REPO_PATH.finditer(text)]
    ours += [(PACKAGE, m) for m in PACKAGE_PATH.finditer(text)]
    refs = [(root / m[1], m[2], m[0]) for root, m in ours
            if not OTHER_REPOSITORY.search(text, max(0, m.start() - 60), m.start())]
    for path, name, shown in refs:
        if not path.exists():
            wrong.append(f"{shown}: no such file")
        elif name and path.suffix == ".py" and name not in defined_names(path):
            wrong.append(f"{shown}: {path.name} defines no {name}")
    for m in BARE_FILE.finditer(text):
        found = files_named(m[1])
        if not found:
            wrong.append(f"{m[0]}: no such file")
        elif m[2] and not any(m[2] in defined_names(p) for p in found):
            wrong.append(f"{m[0]}: no {m[1]} defines {m[2]}")
    return wrong


def module_problems(text: str) -> list[str]:
    """`trainwise.a.b.c`: the longest prefix that is a module, then a name it defines."""
    wrong = []
    for dotted in sorted(set(MODULE.findall(text)) - NOT_MODULES):
        parts, path = dotted.split("."), None
        for i in range(len(parts), 0, -1):
            base = ROOT / "src" / Path(*parts[:i])
            path = next((p for p in (base.with_suffix(".py"), base / "__init__.py")
                         if p.is_file()), None)
            if path is not None:
                rest = parts[i:]
                break
        if path is None or (rest and rest[0] not in defined_names(path)):
            wrong.append(f"{dotted}: no such module or name")
    return wrong


@cache
def source_text() -> str:
    """The package's code, and the test suite's own machinery (tests/*.py: its limits and
    helpers, which development.md documents), not the tests themselves."""
    suite = sorted(Path(__file__).resolve().parents[1].glob("*.py"))
    return "\n".join(p.read_text() for p in [*sorted(PACKAGE.rglob("*.py")), *suite])


def variable_problems(text: str) -> list[str]:
    """`TRAINWISE_X` variables that no source file reads."""
    return [f"{v}: read nowhere in src/ or the suite's machinery"
            for v in sorted(set(VARIABLE.findall(text)))
            if v not in source_text()]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_and_module_a_doc_names_exists(doc: Path):
    text = doc.read_text()
    assert path_problems(text) + module_problems(text) + variable_problems(text) == []


def test_the_check_catches_a_stale_name():
    """The test can fail: old paths, a name the file lacks, a moved module."""
    text = (
        "see run/job.py and `tests/unit/test_gone.py`, `run/job/resolve.py:check_world`,"
        " `faults.py:Faults` (kept), `nothing_here.py`, trainwise.run.faults and"
        " trainwise.plan.no_such_name; RUN/hang/x.py, NVIDIA/nccl `src/graph/tuning.cc` and"
        " trainwise.events are not ours"
    )
    assert path_problems(text) == [
        "tests/unit/test_gone.py: no such file",
        "run/job.py: no such file",
        "run/job/resolve.py:check_world: resolve.py defines no check_world",
        "`nothing_here.py`: no such file",
    ]
    assert module_problems(text) == [
        "trainwise.plan.no_such_name: no such module or name",
        "trainwise.run.faults: no such module or name",
    ]
    assert variable_problems("TRAINWISE_FAULTS, not TRAINWISE_TEST_VERSIONS") == [
        "TRAINWISE_TEST_VERSIONS: read nowhere in src/ or the suite's machinery"
    ]
