"""The package's shape: no import cycle anywhere in minispec/, lazy imports included.

The core is meant to be read in order (config -> cache -> model -> sampling -> generate ->
drafters -> speculative); a cycle, even one hidden inside a function, breaks that order.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "minispec"


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


def test_the_core_reads_in_order():
    """No core module imports one that comes after it on the reading path (the model's methods are the
    generate, speculate and checkpoint functions, so model is read with those)."""
    order = ["config", "cache", "sampling", "generate", "drafters", "adaptive", "speculative"]
    g = graph()
    for i, m in enumerate(order):
        later = {f"minispec.{n}" for n in order[i + 1:]}
        assert not g[f"minispec.{m}"] & later, f"minispec.{m} imports {sorted(g[f'minispec.{m}'] & later)}"
    assert "minispec.model" not in set().union(*(g[f"minispec.{m}"] for m in order))
