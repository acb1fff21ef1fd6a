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
