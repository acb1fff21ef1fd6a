"""The package's shape: the modules read in the order docs/design.md lists them, and no import cycle.

docs/design.md's "Modules, in reading order" is the order a reader takes; no module may import one
listed after it, at the top or inside a function, and every module of minispec/ must be on the list.
A cycle, even one hidden inside a function, would break any such order.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "minispec"
DESIGN = PACKAGE.parent / "docs" / "design.md"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The minispec modules `path` imports, at the top or inside a function."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "minispec"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "minispec":
                continue
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}  # `from . import controls` names a module
    return out


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    # a package's __init__ imports its submodules by design; the edges that matter are between modules
    return {m: {i for i in imports(p) if i in files and i != m} for m, p in files.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(g.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (c := visit(n)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_no_import_cycle_in_the_package():
    g = graph()
    # the top-level package re-exports everything; importing it from a submodule would be a cycle through it
    g = {m: deps - {"minispec"} for m, deps in g.items()}
    cycle = find_cycle(g)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def reading_order(text: str) -> list[str]:
    """The module names of the numbered list under "## Modules, in reading order" ("1. `minispec/x.py`: ...")."""
    section = re.search(r"^## Modules, in reading order\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, 'docs/design.md has no section "## Modules, in reading order"'
    paths = re.findall(r"^\d+\. `(minispec/[\w/]+\.py)`", section.group(1), re.M)
    return [module_name(PACKAGE.parent / p) for p in paths]


def test_the_reading_order_parser():
    text = ("## Modules, in reading order\n\nIntro.\n\n1. `minispec/a.py`: one.\n2. `minispec/sub/__init__.py`: "
            "two,\n   wrapped.\n10. `minispec/sub/b.py`: three.\n\n`minispec/c.py` is prose.\n\n## Next\n"
            "3. `minispec/d.py`: another section.\n")
    assert reading_order(text) == ["minispec.a", "minispec.sub", "minispec.sub.b"]


def test_the_modules_read_in_the_order_design_md_lists_them():
    """No module imports one listed after it in docs/design.md, and every module is listed (the package's
    __init__, which re-exports the public names, apart). The model's methods are the generate, speculate and
    checkpoint functions, so model is listed after those."""
    order = reading_order(DESIGN.read_text(encoding="utf-8"))
    assert len(order) == len(set(order)), f"listed twice: {sorted({m for m in order if order.count(m) > 1})}"
    g = graph()
    assert not set(order) - set(g), f"listed in docs/design.md but not in minispec/: {sorted(set(order) - set(g))}"
    unlisted = set(g) - set(order) - {"minispec"}
    assert not unlisted, f"not listed in docs/design.md's reading order: {sorted(unlisted)}"
    for i, m in enumerate(order):
        # `from . import x` also names the package itself (the cycle test drops that edge for the same reason)
        later = (g[m] - {"minispec"}) & set(order[i + 1:])
        assert not later, f"{m} imports {sorted(later)}, listed after it in docs/design.md"


# ---- function lengths: speculate reads as one loop, and no function of minispec/ runs past a screen

SPECULATE_MAX = 40  # speculate: choose, propose, verify, commit, observe, and its docstring
FUNCTION_MAX = 60  # every function of minispec/, equivalence/ included


def function_lengths(path: Path, root: Path = PACKAGE.parent) -> dict[str, int]:
    """Every function of a file (methods and nested ones too), as "path:name" -> its lines, decorators and
    docstring included (two of one name: the longer)."""
    out: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            key = f"{path.relative_to(root).as_posix()}:{node.name}"
            out[key] = max(out.get(key, 0), node.end_lineno - first + 1)
    return out


def test_function_lengths_count_decorators_and_docstrings(tmp_path):
    f = tmp_path / "f.py"
    f.write_text('@dec\ndef a():\n    """Doc."""\n    return 1\n\n\nclass C:\n    def b(self):\n        pass\n')
    assert function_lengths(f, tmp_path) == {"f.py:a": 4, "f.py:b": 2}


def test_speculate_and_every_function_are_short():
    lengths: dict[str, int] = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        lengths.update(function_lengths(p))
    assert lengths["minispec/speculative.py:speculate"] <= SPECULATE_MAX
    too_long = {k: n for k, n in lengths.items() if n > FUNCTION_MAX}
    assert not too_long, f"over {FUNCTION_MAX} lines: {too_long}"
