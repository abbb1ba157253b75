"""The strategy words (single, ddp, fsdp, hsdp, auto and the planner's row names) are read
in config/ only: everywhere else the code asks the layout value (ParallelDims, or
LayoutRequest before the world size is known). An AST scan of src for comparisons with a
word (==, !=, in, not in; a tuple of words, or a module constant holding one), for
tables keyed by words (dict literals, match cases) and for lookups by a word."""

from __future__ import annotations

import ast
from pathlib import Path

from trainwise.config.parallel_dims import PLAN_NAMES, STRATEGY_WORDS

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "trainwise"
# "auto" is also the word of many other settings (data.format, checkpoint.resume, ...): it
# counts only beside something named strategy, or a name its function bound to one.
WORDS = (set(STRATEGY_WORDS) | set(PLAN_NAMES)) - {"auto"}


def _words(node: ast.AST, constants: dict[str, set[str]]) -> set[str]:
    """The strategy words a value is or holds: a string, a tuple / list / set of them, or
    a module-level constant bound to one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return set().union(*(_words(e, constants) for e in node.elts)) if node.elts else set()
    if isinstance(node, ast.Name):
        return constants.get(node.id, set())
    return set()


def _constants(tree: ast.Module) -> dict[str, set[str]]:
    """Module-level names bound to strings or collections of them."""
    out: dict[str, set[str]] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = _words(stmt.value, out)
    return out


def _mentions_strategy(node: ast.AST, names: set[str]) -> bool:
    """Whether `node` names a strategy (cfg.parallel.strategy, strategy, ...) or uses one
    of `names` (bound to one)."""
    for n in ast.walk(node):
        name = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else ""
        if "strategy" in name.lower() or name in names:
            return True
    return False


def _strategy_names(scope: ast.AST) -> set[str]:
    """The names a function (or the module) binds to a strategy: its arguments named so,
    and what it assigns from an expression that says strategy."""
    names: set[str] = set()
    if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
        args = [*scope.args.posonlyargs, *scope.args.args, *scope.args.kwonlyargs]
        names = {a.arg for a in args if "strategy" in a.arg}
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign) and _mentions_strategy(node.value, names):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _hits(found: set[str], beside: list[ast.AST], names: set[str]) -> set[str]:
    """The words that count: any but auto; auto beside something named strategy."""
    hits = found & WORDS
    if "auto" in found and any(_mentions_strategy(n, names) for n in beside):
        hits.add("auto")
    return hits


def _decision(
    node: ast.AST, constants: dict[str, set[str]], names: set[str]
) -> tuple[str, set[str]]:
    """What `node` does with strategy words, and which ones (none: nothing); `names`: those
    its function binds to a strategy."""
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        found = set().union(*(_words(side, constants) for side in sides))
        return "compares with", _hits(found, sides, names)
    if isinstance(node, ast.Dict):  # a table: two keys or more (one is a record's field)
        found = set().union(set(), *(_words(k, constants) for k in node.keys if k is not None))
        return "keys a table by", found & WORDS if len(found & WORDS) > 1 else set()
    if isinstance(node, ast.MatchValue):
        return "matches", _words(node.value, constants) & WORDS
    if isinstance(node, ast.Subscript):
        return "looks up", _words(node.slice, constants) & WORDS
    return "", set()


def word_uses(path: Path, shown: str) -> list[str]:
    """`shown:line: ...` for each place `path` decides by a strategy word, in line order."""
    tree = ast.parse(path.read_text(), str(path))
    constants = _constants(tree)
    out = []

    def visit(node: ast.AST, names: set[str]) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names = names | _strategy_names(node)  # the innermost function's bindings too
        what, words = _decision(node, constants, names)
        if words:
            out.append((node.lineno, f"{shown}:{node.lineno}: {what} {', '.join(sorted(words))}"))
        for child in ast.iter_child_nodes(node):
            visit(child, names)

    visit(tree, set())
    return [line for _, line in sorted(out)]


def test_no_module_outside_config_decides_by_a_strategy_word():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        shown = "/".join(path.relative_to(PACKAGE).parts)
        if not shown.startswith("config/"):
            found += word_uses(path, shown)
    assert found == []


def test_the_scan_catches_a_comparison_a_table_and_a_constant(tmp_path: Path):
    """The test can fail: each way of deciding by a word is found; other uses of "auto"
    a row's name handed to the planner and a record's field named fsdp are not."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "SHARDED = ('fsdp', 'hsdp')\n"
        "def f(job, cfg, mode, evaluate, inputs):\n"
        "    if job.strategy == 'ddp':\n"
        "        return {'single': 1, 'fsdp-full': 2}[job.name]\n"
        "    if cfg.parallel.strategy in ('auto', 'single'):\n"
        "        return job.plan_name in SHARDED\n"
        "    match job.name:\n"
        "        case 'hsdp':\n"
        "            return ROWS['fsdp-offload']\n"
        "    if mode == 'auto' or cfg.backend != 'auto':\n"
        "        return evaluate(inputs, 'single')\n"
        "    return {'fsdp': job.fsdp, 'tp': job.tp}\n"
        "def g(cfg, key):\n"
        "    value = cfg.plan.strategy if key else cfg.parallel.strategy\n"
        "    return value not in (None, 'auto')\n"
        "def h(value):\n"
        "    return value == 'auto'\n"
    )
    assert word_uses(probe, "plan/probe.py") == [
        "plan/probe.py:3: compares with ddp",
        "plan/probe.py:4: keys a table by fsdp-full, single",
        "plan/probe.py:5: compares with auto, single",
        "plan/probe.py:6: compares with fsdp, hsdp",
        "plan/probe.py:8: matches hsdp",
        "plan/probe.py:9: looks up fsdp-offload",
        "plan/probe.py:15: compares with auto",
    ]
