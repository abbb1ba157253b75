"""The tests' time limits: every one in tests/ comes from hang_limit (tests/limits.py), no
test asserts a wall time, and no test sleeps to wait (wait_until polls a condition). An
ast scan of every file under tests/, with cases of its own that it must flag; then the
limit helpers themselves on a machine speed given, not measured."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import limits
from limits import Hung, Speed, communicate, grown, hang_limit, wait_until

TESTS = Path(__file__).parents[1]
PYPROJECT = TESTS.parent / "pyproject.toml"
# The one place the limits are computed (its calibration ceiling is the one fixed figure,
# its polling sleep the one sleep), the calibration launch's worker, which times steps, and
# this file, whose cases are what the scan must flag.
EXEMPT = {"limits.py", "speed_worker.py", "test_limits.py"}
CLOCKS = {"time", "monotonic", "perf_counter", "time_ns", "monotonic_ns", "perf_counter_ns"}
LIMIT_SUFFIX = "_limit"  # hang_limit, and a module's functions that compute from it
LIMIT_WORDS = ("timeout", "limit")  # in the names of keywords and parameters that hold one
WAITS = {"communicate", "wait", "result", "join"}  # methods whose first argument is a limit
SETTINGS = ("timeout_s=", "last_call_s=")  # a job's own time limits, as --set text


def _is_clock(node: ast.AST) -> bool:
    """time.time(), time.monotonic(), perf_counter()... (a reading of the clock)."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return (isinstance(f, ast.Attribute) and f.attr in CLOCKS
            and isinstance(f.value, ast.Name) and f.value.id == "time") or (
        isinstance(f, ast.Name) and f.id in CLOCKS - {"time"})


def _is_hang_limit(node: ast.AST) -> bool:
    """A call of hang_limit, or of a module's own *_limit function (which must call it)."""
    f = node.func if isinstance(node, ast.Call) else None
    name = getattr(f, "id", None) or getattr(f, "attr", None)
    return isinstance(name, str) and name.endswith(LIMIT_SUFFIX)


def _literal_numbers(node: ast.AST, constants: dict[str, float]) -> list[float]:
    """Non-zero numbers written in `node` (or module constants it names), outside any
    hang_limit(...) call. Zero passes: a limit of 0 waits for nothing."""
    if _is_hang_limit(node):
        return []
    if isinstance(node, ast.Constant):
        is_number = isinstance(node.value, int | float) and not isinstance(node.value, bool)
        return [node.value] if is_number and node.value != 0 else []
    if isinstance(node, ast.Name) and node.id in constants:
        return [constants[node.id]] if constants[node.id] != 0 else []
    return [n for child in ast.iter_child_nodes(node) for n in _literal_numbers(child, constants)]


def _is_number(node: ast.AST, constants: dict[str, float]) -> bool:
    """A non-zero number written as such (or arithmetic of them, or a module constant)."""
    if isinstance(node, ast.BinOp):
        return _is_number(node.left, constants) or _is_number(node.right, constants)
    simple = isinstance(node, ast.Constant | ast.Name | ast.UnaryOp)
    return simple and bool(_literal_numbers(node, constants))


def _module_constants(tree: ast.Module) -> dict[str, float]:
    """NAME = <number> at the top of the module."""
    found = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, int | float)):
            found.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return found


def _is_limit_word(name: str | None) -> bool:
    return bool(name) and any(w in name.lower() for w in LIMIT_WORDS)


def _clock_names(function: ast.AST) -> set[str]:
    """Names a function assigns from a clock reading, directly or through other such names."""
    names: set[str] = set()
    assigns = [n for n in ast.walk(function) if isinstance(n, ast.Assign | ast.AnnAssign)]
    while True:
        grown = set(names)
        for a in assigns:
            if _reads_clock(a.value, names):
                targets = a.targets if isinstance(a, ast.Assign) else [a.target]
                grown |= {t.id for t in targets if isinstance(t, ast.Name)}
        if grown == names:
            return names
        names = grown


def _reads_clock(node: ast.AST | None, names: set[str]) -> bool:
    if node is None:
        return False
    return any(_is_clock(n) or (isinstance(n, ast.Name) and n.id in names) for n in ast.walk(node))


def _compares_clock(test: ast.AST, names: set[str]) -> bool:
    """A comparison with a clock reading as an operand (a reading passed to a function that
    is compared is the function's business, not a wall time asserted)."""
    def bare(node: ast.AST) -> bool:  # a clock in `node`, not inside a call's arguments
        if _is_clock(node) or (isinstance(node, ast.Name) and node.id in names):
            return True
        return not isinstance(node, ast.Call) and any(map(bare, ast.iter_child_nodes(node)))

    return any(isinstance(n, ast.Compare) and any(map(bare, [n.left, *n.comparators]))
               for n in ast.walk(test))


def findings(source: str, name: str = "<case>") -> list[str]:
    """Where `source` writes a literal time limit, asserts a wall time or sleeps to wait."""
    tree = ast.parse(source)
    constants = _module_constants(tree)
    found = []

    def flag(node: ast.AST, what: str) -> None:
        found.append(f"{name}:{node.lineno}: {what}")

    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    for fn in functions:
        args = fn.args.posonlyargs + fn.args.args
        given = args[len(args) - len(fn.args.defaults):]
        defaults = list(zip(given, fn.args.defaults, strict=True))
        defaults += [(a, d) for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults, strict=True)
                     if d]
        for arg, default in defaults:
            if _is_limit_word(arg.arg) and _literal_numbers(default, constants):
                flag(default, f"a literal default limit ({arg.arg}): use hang_limit(...)")
        if fn.name.endswith(LIMIT_SUFFIX) and not any(map(_is_hang_limit, ast.walk(fn))):
            flag(fn, f"{fn.name} computes a limit without hang_limit")
        clock = _clock_names(fn)
        for node in ast.walk(fn):
            if isinstance(node, ast.Assert) and _compares_clock(node.test, clock):
                flag(node, "asserts a wall time")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            attr = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            for kw in node.keywords:
                if _is_limit_word(kw.arg) and _literal_numbers(kw.value, constants):
                    flag(node, f"a literal limit ({kw.arg}=): use hang_limit(...)")
            if attr in WAITS and node.args and _is_number(node.args[0], constants):
                flag(node, f"a literal limit (.{attr}(N)): use hang_limit(...)")
            if attr == "timeout" and any(_literal_numbers(a, constants) for a in node.args):
                flag(node, "a literal pytest.mark.timeout: use hang_limit(...)")
            if attr == "sleep":
                flag(node, "sleeps: wait for a condition with wait_until")
        elif isinstance(node, ast.BinOp) and (_is_clock(node.left) or _is_clock(node.right)):
            other = node.right if _is_clock(node.left) else node.left
            if _literal_numbers(other, constants):
                flag(node, "a deadline from a literal: use wait_until / hang_limit(...)")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if any(f"{s}" in node.value and _number_after(node.value, s) for s in SETTINGS):
                flag(node, f"a literal time limit in a job's settings ({node.value!r})")
        elif isinstance(node, ast.JoinedStr):
            parts = node.values
            for text, value in zip(parts[:-1], parts[1:], strict=True):
                if (isinstance(text, ast.Constant) and str(text.value).endswith(SETTINGS)
                        and isinstance(value, ast.FormattedValue)
                        and _literal_numbers(value.value, constants)):
                    flag(node, "a literal time limit in a job's settings (f-string)")
    return found


def _number_after(text: str, setting: str) -> bool:
    rest = text.split(setting, 1)[1]
    return rest[:1].isdigit() and rest.rstrip("0.") != ""


CASES = {
    "subprocess.run(cmd, timeout=240)": 1,
    "proc.communicate(timeout=30)": 1,
    "proc.communicate(30)": 1,
    "proc.wait(15)": 1,
    "future.result(timeout=LIMIT)\nLIMIT = 60": 1,
    "run_cli('x', cwd=d, timeout=hang_limit() + 60)": 1,
    "pytestmark = pytest.mark.timeout(600)": 1,
    "pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]": 1,
    "def wait_for(path, timeout: float = 120): pass": 1,
    "def f(*, limit=5): pass": 1,
    "deadline = time.monotonic() + 120": 1,
    "time.sleep(0.2)": 1,
    "def slow_limit():\n    return 600": 1,
    "def _limit(name):\n    return hang_limit(procs=RUNS[name])\nrun(timeout=_limit('a'))": 0,
    "sleep(1)": 1,
    "args = ['--set', 'parallel.timeout_s=60']": 1,
    "TIMEOUT_S = 20\nargs = [f'parallel.timeout_s={TIMEOUT_S}']": 1,
    "def test():\n    start = time.perf_counter()\n    work()\n"
    "    assert time.perf_counter() - start >= 0.06": 1,
    "def test():\n    t0 = time.monotonic()\n    work()\n    took = time.monotonic() - t0\n"
    "    assert took < 5": 1,
    "def test():\n    before = time.time()\n    assert before <= stamp()": 1,
    # What passes: limits from hang_limit, a zero limit, clock readings handed to code.
    "run_cli('x', cwd=d, timeout=hang_limit(launches=2, steps=10, procs=4))": 0,
    "pytestmark = pytest.mark.timeout(hang_limit(launches=3))": 0,
    "proc.wait(timeout=0)": 0,
    "def test():\n    assert not is_repeat(sig, (sig, time.monotonic()))": 0,
    "wait_until(lambda: path.exists(), limit=hang_limit(), what='x')": 0,
    "args = ['--set', 'parallel.timeout_s=' + str(int(hang_limit()))]": 0,
    "args = [f'parallel.timeout_s={hang_limit(factor=1)}']": 0,
}


@pytest.mark.parametrize("source, count", CASES.items())
def test_the_scan_flags_what_it_should_and_only_that(source: str, count: int):
    assert len(findings(source)) == count, findings(source)


def test_no_literal_limit_no_wall_time_assert_and_no_sleep_under_tests():
    files = [p for p in sorted(TESTS.rglob("*.py")) if p.name not in EXEMPT]
    assert len(files) > 100  # the scan reaches every tier
    found = [f for p in files for f in findings(p.read_text(), str(p.relative_to(TESTS)))]
    assert not found, "\n".join(found)


def test_pytest_has_no_fixed_default_timeout():
    """pytest-timeout's limit of a test without a mark comes from tests/conftest.py."""
    import tomllib

    options = tomllib.loads(PYPROJECT.read_text())["tool"]["pytest"]["ini_options"]
    assert "timeout" not in options and "timeout" not in options.get("addopts", "")


@pytest.fixture
def speed(monkeypatch: pytest.MonkeyPatch) -> Speed:
    given = Speed(launch_s=10.0, step_s=0.1, sharers=3, load=1.0)
    monkeypatch.setattr(limits, "_speed", given)
    monkeypatch.setattr(limits, "load_average", lambda: 1.0)  # as crowded as then
    monkeypatch.setattr(limits, "_first_crowding", None)
    return given


def test_a_limit_follows_the_measured_speed_and_the_work(speed: Speed, monkeypatch):
    one = hang_limit()
    assert one == limits.HANG_FACTOR * 3 * 10.0  # one standard launch, 3 test processes
    assert hang_limit(launches=0) == one == hang_limit(procs=1)  # never less than a launch
    assert hang_limit(launches=3) == 3 * one
    assert hang_limit(procs=4) == pytest.approx(one * 5 / 3)  # 5 processes against 3
    assert hang_limit(steps=100) == pytest.approx(one + limits.HANG_FACTOR * 3 * 100 * 0.1)
    assert hang_limit(factor=1) == one / limits.HANG_FACTOR
    before = hang_limit(launches=2, steps=20)
    monkeypatch.setattr(limits, "_speed", Speed(launch_s=30.0, step_s=0.3, sharers=3))
    assert hang_limit(launches=2, steps=20) == pytest.approx(3 * before)  # 3x slower: 3x
    monkeypatch.setattr(limits, "_speed", Speed(launch_s=30.0, step_s=0.3, sharers=1))
    assert hang_limit(launches=2, steps=20) == pytest.approx(before)  # alone on the machine


def test_a_limit_grows_with_the_load_since_the_measurement(speed: Speed, monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(limits, "_speed", replace(speed, load=2.0 * cores))  # 2 a core then
    monkeypatch.setattr(limits, "load_average", lambda: 2.0 * cores)
    then = hang_limit(launches=2)  # sized at collection, say
    assert then == 2 * limits.HANG_FACTOR * 3 * 10.0 and grown(then) == then
    monkeypatch.setattr(limits, "load_average", lambda: 6.0 * cores)  # 3x as crowded now
    assert hang_limit(launches=2) == pytest.approx(3 * then)
    assert grown(then) == pytest.approx(3 * then)  # a mark sized then, as its test starts
    assert "3.0x as crowded now" in str(limits.machine_speed())  # a Hung message says so
    monkeypatch.setattr(limits, "load_average", lambda: 0.5)  # quieter: never less
    assert hang_limit(launches=2) == then and grown(then) == then


def test_wait_until_returns_the_condition_or_names_what_did_not_happen(speed: Speed):
    assert wait_until(lambda: 7, limit=0, what="a seven") == 7
    with pytest.raises(Hung, match="the marker: not after its hang limit of 0 s"):
        wait_until(lambda: None, limit=0, what="the marker")
    done = subprocess.Popen([sys.executable, "-c", "print('bye')"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    done.wait()
    with pytest.raises(AssertionError, match="ended \\(exit 0\\) before the marker:\n.*bye"):
        wait_until(lambda: None, limit=hang_limit(), what="the marker", procs=[done])


def test_a_launch_past_its_limit_is_killed_with_what_it_started(speed: Speed):
    # A parent that starts a child in a session of its own (as torchrun starts its workers),
    # both of which would outlive any test.
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(600)'], start_new_session=True); print(c.pid, flush=True);"
            " time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    child = int(wait_until(proc.stdout.readline, limit=hang_limit(), what="the child's pid"))
    with pytest.raises(Hung, match="the sleeper: still running after its hang limit of 0 s") as e:
        communicate(proc, limit=0, what="the sleeper")
    assert "killed it and 1 process(es) it started" in str(e.value)
    assert str(speed) in str(e.value)  # where the limit came from
    assert proc.returncode is not None
    wait_until(lambda: not Path(f"/proc/{child}").exists() or _zombie(child),
               limit=hang_limit(), what="the child's end")


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
