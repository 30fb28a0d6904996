"""The package's shape: no import cycle among `pagedjax`'s modules.

Every module's `import` / `from` statements are read with `ast`, at module level and inside
functions (a lazy import is still a dependency), `if TYPE_CHECKING:` blocks included;
relative imports are resolved, and `from pagedjax.x import y` counts as importing `pagedjax.x.y`
when y is a submodule. A package's `__init__` is an edge only where something imports the
package itself. The graph must be acyclic.

No module of the package is over `MAX_LINES` lines: a longer file is split by concern.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pagedjax

ROOT = Path(pagedjax.__file__).parent
MAX_LINES = 500


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """{dotted module name: file} for every .py file of the package."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imported_modules(module: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `module` imports anywhere in its file."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module if is_pkg else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            subs = {f"{target}.{a.name}" for a in node.names} & known
            # `from pkg import sub` imports the submodule (and runs pkg/__init__, which the
            # submodule's own import implies); `from pkg import name` imports pkg itself
            if not subs or len(subs) < len(node.names):
                out.add(target)
            out |= subs
    return {m for m in out if m in known and m != module}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = module_files(root)
    known = set(files)
    return {m: imported_modules(m, p, known) for m, p in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_graph_sees_lazy_relative_and_submodule_imports():
    graph = import_graph()
    assert "pagedjax.ops.cpu_kernels" in graph["pagedjax.ops.cpu_attention"]  # module level
    assert "pagedjax.models.loader" in graph["pagedjax.config_resolution"]  # in a function
    assert "pagedjax.ops.paged_attention_pallas" in graph["pagedjax.ops.attention"]
    assert "pagedjax.models" not in graph["pagedjax.config_resolution"]  # `from pkg import sub`
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def long_files(root: Path = ROOT, limit: int = MAX_LINES) -> dict[str, int]:
    """{path relative to the package's parent: line count} of the .py files over `limit`."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        n = len(path.read_text().splitlines())
        if n > limit:
            out[str(path.relative_to(root.parent))] = n
    return out


def test_long_files_sees_a_file_over_the_limit(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "short.py").write_text("x = 1\n" * 3)
    (tmp_path / "pkg" / "long.py").write_text("x = 1\n" * 4)
    assert long_files(tmp_path / "pkg", limit=3) == {"pkg/long.py": 4}


def test_no_file_over_max_lines():
    over = long_files()
    assert not over, f"files over {MAX_LINES} lines (split them by concern): {over}"
