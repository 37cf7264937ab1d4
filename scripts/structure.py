"""The code's shape, measured with ast over `rollouts/`: the measures issue 46 holds it to.

    python scripts/structure.py            # every measure, and what breaks each limit
    python scripts/structure.py --check    # exit 1 when a limit is broken

Rooms are the folders under `rollouts/` (a top-level module is the room "rollouts"). Imports run
downward through LAYERS; an import of a room in a higher layer is an upward import, and rooms that
import each other (directly or round a loop) form a room cycle. Lazy imports inside functions count:
they tie rooms as surely as top-level ones. Also measured: module and function lengths, and
parameters past the config that carry a mode as a bare `str` (a name in MODE_NAMES).
"""

from __future__ import annotations

import argparse
import ast
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rollouts"
# lowest first; a room imports only rooms of its own layer or below (and never round a cycle)
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"rollouts", "wire", "forkserver"}),
    frozenset({"config", "models"}),
    frozenset({"algorithms", "rewards", "data", "envs", "recipes"}),
    frozenset({"engine", "inference", "trainer", "weights", "rollout", "gateway"}),
    frozenset({"loop"}),
    frozenset({"driver"}),
)
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
MODE_NAMES = ("mode", "_mode", "kind", "delivery", "policy", "strategy", "backend")


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room_of(module: str) -> str:
    """`rollouts.inference.pool` -> `inference`; `rollouts.types` -> `rollouts`."""
    parts = module.split(".")
    if len(parts) < 2 or not (PACKAGE / parts[1]).is_dir():
        return "rollouts"
    return parts[1]


def _imports(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("rollouts"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.startswith("rollouts"):
                out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names)
    return out


def _layer(room: str) -> int:
    for i, layer in enumerate(LAYERS):
        if room in layer:
            return i
    raise SystemExit(f"room {room!r} is in no layer of scripts/structure.py LAYERS: add it")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one room (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def _str_modes(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
    return [
        a.arg
        for a in args
        if isinstance(a.annotation, ast.Name | ast.Constant)
        and (a.annotation.id if isinstance(a.annotation, ast.Name) else a.annotation.value) == "str"
        and a.arg.endswith(MODE_NAMES)
    ]


def measure() -> dict:
    """Every measure, and the places that break a limit."""
    modules = {_name(p): p for p in _modules()}
    graph: dict[str, set[str]] = defaultdict(set)
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    long_modules, long_functions, str_modes, lengths = [], [], [], []
    for name, path in modules.items():
        text = path.read_text()
        tree = ast.parse(text)
        room = room_of(name)
        graph[room]
        for target in _imports(tree, name, path.name == "__init__.py"):
            other = room_of(target)
            if other != room and (target in modules or target.rsplit(".", 1)[0] in modules):
                graph[room].add(other)
                edges[(room, other)].append(f"{name} -> {target}")
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES and room != "config":
            long_modules.append(f"{path.relative_to(ROOT)}: {lines} lines")
        for fn in _functions(tree):
            n = fn.end_lineno - fn.lineno + 1
            lengths.append(n)
            if n > MAX_FUNCTION_LINES:
                long_functions.append(f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name}: {n} lines")
            if room != "config":
                str_modes += [
                    f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name}({a}: str)"
                    for a in _str_modes(fn)
                ]
    upward = [
        f"{a} -> {b}: {edges[(a, b)][0]}"
        + (f" (+{len(edges[(a, b)]) - 1})" if len(edges[(a, b)]) > 1 else "")
        for a in sorted(graph)
        for b in sorted(graph[a])
        if _layer(b) > _layer(a)
    ]
    return {
        "modules": len(modules),
        "function_lines": {
            "median": statistics.median(lengths),
            "p90": statistics.quantiles(lengths, n=10)[-1],
            "max": max(lengths),
        },
        "room_cycles": _cycles(graph),
        "cycle_edges": {
            f"{a} -> {b}": edges[(a, b)]
            for comp in _cycles(graph)
            for a in comp
            for b in graph[a]
            if b in comp and _layer(b) >= _layer(a)  # the edges against (or across) the layers
        },
        "upward_imports": upward,
        "long_modules": long_modules,
        "long_functions": long_functions,
        "str_modes": str_modes,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a limit is broken")
    args = parser.parse_args()
    m = measure()
    f = m["function_lines"]
    print(f"modules {m['modules']}; function lines", end=" ")
    print(f"median {f['median']}, p90 {f['p90']:.0f}, max {f['max']}")
    broken = 0
    for key, title in (
        ("room_cycles", "room cycles"),
        ("upward_imports", "upward imports"),
        ("long_modules", f"modules over {MAX_MODULE_LINES} lines"),
        ("long_functions", f"functions over {MAX_FUNCTION_LINES} lines"),
        ("str_modes", "modes passed as str past the config"),
    ):
        items = m[key]
        broken += len(items)
        print(f"{title}: {len(items)}")
        for item in items:
            print(f"  {item}")
    for edge, where in m["cycle_edges"].items():
        print(f"  cycle edge {edge}: {', '.join(where[:3])}" + (" ..." if len(where) > 3 else ""))
    return 1 if args.check and broken else 0


if __name__ == "__main__":
    sys.exit(main())
