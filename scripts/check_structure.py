"""The source tree's shape, read with Python's ast (nothing is imported): import circles, floors, rooms, arrows back
up and long functions.

    python3 scripts/check_structure.py            # src/treeattn: circles, floors, rooms, arrows back up, long functions
    python3 scripts/check_structure.py --verbose  # and every module's floor

An import is an edge from the importing module to the module it names (`from pkg import name` names
pkg.name when that is a module, else pkg), wherever it stands: at the top of a file or inside a
function (a lazy import closes a circle all the same). `if TYPE_CHECKING:` blocks count too.
A circle is a strongly connected component of more than one module. A module's floor is 0 when it
imports no treeattn module, else one more than the highest floor it imports (a circle shares one
floor). A room is a package folder (treeattn/x/, and engine/worker/) or the package's top-level modules; an
arrow back up is an import of the package root `treeattn` from inside a room, or an import from a room to a
room later in ROOM_ORDER (the layers of DESIGN.md: ops < parallel < cache < models < ... < serve; engine/worker
counts as engine; imports inside a room are not counted). A function's body is its lines from the first statement to the last;
kernels (ops/triton_*)
are exempt from the 80-line bound. Exit status 1 when there is a circle, an arrow back up or a long function.
tests/test_structure.py runs the circle and arrow checks in the suite (tests/test_function_length.py the long bodies).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "treeattn"
MAX_BODY_LINES = 80
KERNEL_FILES = ("treeattn/ops/triton_decode.py",)


ROOM_ORDER = ("ops", "parallel", "cache", "models", "linear", "engine", "hf", "commands", "sim", "bench", "eval", "serve",
              "(top)")
"""The rooms from the lowest floor up: a room imports only rooms before it."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, ast.Module]]:
    trees = {module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted((root / PACKAGE).rglob("*.py"))}
    packages = {module_name(p) for p in (root / PACKAGE).rglob("__init__.py")}
    graph: dict[str, set[str]] = {m: set() for m in trees}
    for name, tree in trees.items():
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importing module's package
                    pkg = name.split(".") if name in packages else name.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in trees else base for a in node.names]
            for target in targets:
                while target and target not in trees:  # `import treeattn.x.y` of a name inside a module
                    target = target.rpartition(".")[0]
                if target.startswith(PACKAGE) and target != name:
                    graph[name].add(target)
    return graph, trees


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def floors(graph: dict[str, set[str]], cycles: list[list[str]]) -> dict[str, int]:
    """Each module's floor (a circle's members share theirs)."""
    group = {m: m for m in graph}
    for cycle in cycles:
        for m in cycle:
            group[m] = cycle[0]
    edges: dict[str, set[str]] = {g: set() for g in set(group.values())}
    for m, targets in graph.items():
        edges[group[m]].update(group[t] for t in targets if group[t] != group[m])
    level: dict[str, int] = {}

    def visit(g: str) -> int:
        if g not in level:
            level[g] = 0
            level[g] = 1 + max((visit(t) for t in edges[g]), default=-1)
        return level[g]

    return {m: visit(group[m]) for m in graph}


def room(module: str, root: Path = ROOT) -> str:
    """The room of `module`: its folder under treeattn/ ("engine.worker" for engine/worker/), "(top)" for a
    top-level module, "(root)" for the package itself."""
    parts = module.split(".")[1:]
    if not parts:
        return "(root)"
    if parts[:2] == ["engine", "worker"]:
        return "engine.worker"
    return parts[0] if len(parts) > 1 or (root / PACKAGE / parts[0]).is_dir() else "(top)"


def arrows_back_up(graph: dict[str, set[str]], root: Path = ROOT) -> list[tuple[str, str]]:
    """(importer, imported) of every import that points up: to the package root from a room, or to a room
    later in ROOM_ORDER."""
    back = []
    for module, targets in graph.items():
        for target in targets:
            a, b = (room(m, root).replace("engine.worker", "engine") for m in (module, target))
            if (b == "(root)" and a != "(top)") or (
                a in ROOM_ORDER and b in ROOM_ORDER and ROOM_ORDER.index(b) > ROOM_ORDER.index(a)
            ):
                back.append((module, target))
    return sorted(back)


def long_functions(trees: dict[str, ast.Module], limit: int = MAX_BODY_LINES) -> list[tuple[str, str, int]]:
    """(module, function, body lines) of every function whose body is longer than `limit`, kernels aside."""
    out = []
    for name, tree in trees.items():
        if any(name == k.removesuffix(".py").replace("/", ".") for k in KERNEL_FILES):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body[1:] if ast.get_docstring(node) is not None and len(node.body) > 1 else node.body
                lines = body[-1].end_lineno - body[0].lineno + 1
                if lines > limit:
                    out.append((name, node.name, lines))
    return sorted(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="List every module's floor.")
    args = parser.parse_args()
    graph, trees = import_graph()
    cycles = circles(graph)
    level = floors(graph, cycles)
    long = long_functions(trees)
    back = arrows_back_up(graph)
    rooms = {room(m) for m in graph} - {"(root)", "(top)"}
    print(f"modules: {len(graph)}; import edges: {sum(map(len, graph.values()))}; rooms: {len(rooms)}; floors: "
          f"{max(level.values()) + 1}")
    print(f"import circles: {len(cycles)}")
    for cycle in cycles:
        print("  circle: " + " <-> ".join(cycle))
    print(f"arrows back up: {len(back)}")
    for module, target in back:
        print(f"  {module} -> {target}")
    print(f"function bodies over {MAX_BODY_LINES} lines (kernels aside): {len(long)}")
    for module, function, lines in long:
        print(f"  {module}.{function}: {lines} lines")
    if args.verbose:
        for m in sorted(level, key=lambda m: (level[m], m)):
            print(f"  floor {level[m]:2d}  {m}")
    return 1 if cycles or back or long else 0


if __name__ == "__main__":
    sys.exit(main())
