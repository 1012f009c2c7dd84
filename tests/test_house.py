"""The house's rules, read from the code's own imports (no module is run).

Private names stay inside their module, no two modules import each other (at run time, inside a
function or under TYPE_CHECKING: every import counts), and a room is entered through its
package's public surface. Run as a script to print every break at once.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "planner_svc", "launcher_agent", "shared", "lanes")
HOUSES_OF_ROOMS = ("gateway",)  # packages whose subpackages are rooms, entered only through their __init__


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def product_modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _top_level_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(names a module defines, names it only imports), at its top level, if/try blocks included."""
    defined: set[str] = set()
    imported: set[str] = set()
    body = list(tree.body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.If, ast.Try)):
            body += node.body + node.orelse + getattr(node, "finalbody", []) + [
                n for h in getattr(node, "handlers", []) for n in h.body]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return defined, imported - defined


class Imports:
    """Every import of one module: the modules it names, and private names it takes."""

    def __init__(self, module: str, path: Path, modules: dict[str, Path]):
        self.module = module
        self.targets: set[str] = set()
        self.private: list[str] = []
        self.taken: list[tuple[str, str]] = []  # (module, name) of every from-import of a name
        tree = ast.parse(path.read_text(), str(path))
        self.is_package = path.name == "__init__.py"
        self.defined, self.only_imported = _top_level_names(tree)
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules:
                        self.targets.add(alias.name)
                        aliases[alias.asname or alias.name] = alias.name
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, path, node)
                if source.split(".")[0] not in PACKAGES:
                    continue
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    if submodule in modules:
                        self.targets.add(submodule)
                        aliases[alias.asname or alias.name] = submodule
                    else:
                        self.targets.add(source)
                        self.taken.append((source, alias.name))
                        if _is_private(alias.name):
                            self.private.append(f"{module} takes {source}.{alias.name}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and _is_private(node.attr)
                and aliases[node.value.id] != module
            ):
                self.private.append(f"{module} uses {aliases[node.value.id]}.{node.attr}")
        self.targets.discard(module)


def house() -> dict[str, Imports]:
    modules = product_modules()
    return {name: Imports(name, path, modules) for name, path in modules.items()}


def private_names_taken(imports: dict[str, Imports]) -> list[str]:
    return sorted(line for each in imports.values() for line in each.private)


def names_taken_from_a_module_that_only_imports_them(imports: dict[str, Imports]) -> list[str]:
    """Re-export shims: a name is imported from the module that defines it, or from a package's face."""
    found = []
    for name, each in imports.items():
        for source, taken in each.taken:
            home = imports.get(source)
            if home is not None and not home.is_package and taken in home.only_imported:
                found.append(f"{name} takes {taken} from {source}, which only imports it")
    return sorted(found)


def _room(module: str, rooms: set[str]) -> str | None:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 and ".".join(parts[:2]) in rooms else None


def rooms_entered_from_the_side(imports: dict[str, Imports]) -> list[str]:
    """Imports of a module inside another room, past that room's public surface (its __init__)."""
    rooms = {name for name in imports if name.count(".") == 1 and name.split(".")[0] in HOUSES_OF_ROOMS
             and (ROOT / name.replace(".", "/") / "__init__.py").exists()}
    found = []
    for name, each in imports.items():
        for target in each.targets:
            room = _room(target, rooms)
            if room and target != room and _room(name, rooms) != room:
                found.append(f"{name} imports {target}, not {room}")
    return sorted(found)


def circles(imports: dict[str, Imports]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    graph = {name: sorted(t for t in each.targets if t in imports) for name, each in imports.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
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
                    work.append((child, iter(graph[child])))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
    return sorted(groups)


def test_no_module_takes_another_modules_private_names():
    assert private_names_taken(house()) == []


def with_tests_and_benches(imports: dict[str, Imports]) -> dict[str, Imports]:
    """The product's modules and, as importers only, the tests' and benchmarks' files."""
    modules = product_modules()
    outside = {f"{path.parent.name}.{path.stem}": Imports(f"{path.parent.name}.{path.stem}", path, modules)
               for folder in ("tests", "bench") for path in sorted((ROOT / folder).glob("*.py"))}  # fmt: skip
    return imports | outside


def test_no_name_is_taken_through_a_module_that_only_imports_it():
    assert names_taken_from_a_module_that_only_imports_them(with_tests_and_benches(house())) == []


def test_rooms_are_entered_through_their_public_surface():
    assert rooms_entered_from_the_side(house()) == []


def documented_rooms() -> dict[str, set[str]]:
    """docs/development.md's table of the gateway's rooms: room -> the rooms it may import."""
    text = (ROOT / "docs" / "development.md").read_text()
    table = text.split("## The gateway's rooms", 1)[1].split("\n\n")[2]
    allowed: dict[str, set[str]] = {}
    for row in table.splitlines()[2:]:
        names, _, may = [cell.strip() for cell in row.strip("|").split("|")]
        for name in re.findall(r"`([a-z_]+)(?:/|\.py)`", names):
            allowed[name] = set() if may.startswith(("shared only", "every room")) else set(
                re.findall(r"[a-z_]+", may))  # fmt: skip
            if may.startswith("every room"):
                allowed[name] = {"*"}
    return allowed


def test_each_gateway_room_imports_only_what_the_layout_table_allows():
    allowed = documented_rooms()
    rooms = {path.stem if path.is_file() else path.name for path in (ROOT / "gateway").iterdir()
             if path.suffix == ".py" and path.stem != "__init__" or (path / "__init__.py").exists()}  # fmt: skip
    assert rooms == set(allowed), "every room of gateway/ has its row in docs/development.md, and only those"
    broken = []
    for name, each in house().items():
        parts = name.split(".")
        if parts[0] != "gateway" or len(parts) < 2:
            continue
        for target in each.targets:
            other = target.split(".")
            if other[0] == "gateway" and len(other) > 1 and other[1] != parts[1] and "*" not in allowed[parts[1]] \
                    and other[1] not in allowed[parts[1]]:
                broken.append(f"{name} imports {target}")
    assert broken == []


def test_no_import_circles():
    assert circles(house()) == []


def test_the_checker_sees_a_private_import_and_a_circle(tmp_path, monkeypatch):
    """The rules above are only as good as their reader: a planted break must be seen."""
    package = tmp_path / "gateway"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from gateway.b import _hidden\n")
    (package / "b.py").write_text("def f():\n    from gateway import a\n    return a._x\n_hidden = 1\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", ("gateway",))
    imports = house()
    assert private_names_taken(imports) == ["gateway.a takes gateway.b._hidden", "gateway.b uses gateway.a._x"]
    assert circles(imports) == [["gateway.a", "gateway.b"]]
    (package / "d.py").write_text("from gateway.b import f\n")
    (package / "e.py").write_text("from gateway.d import f\n")
    assert names_taken_from_a_module_that_only_imports_them(house()) == [
        "gateway.e takes f from gateway.d, which only imports it"]
    room = package / "room"
    room.mkdir()
    (room / "__init__.py").write_text("from gateway.room.inner import thing\n")
    (room / "inner.py").write_text("thing = 1\n")
    (package / "c.py").write_text("from gateway.room.inner import thing\nfrom gateway.room import thing\n")
    assert rooms_entered_from_the_side(house()) == ["gateway.c imports gateway.room.inner, not gateway.room"]


if __name__ == "__main__":
    found = house()
    for line in private_names_taken(found):
        print("private:", line)
    for line in names_taken_from_a_module_that_only_imports_them(with_tests_and_benches(found)):
        print("shim:", line)
    for line in rooms_entered_from_the_side(found):
        print("side door:", line)
    for group in circles(found):
        print("circle:", " <-> ".join(group))
