"""The layers of transerve's packages (docs/architecture.md, "Layers"): each package imports only the packages
below it, so there is no cycle between packages. Every module's imports are read with `ast`, those inside
functions and under `TYPE_CHECKING` included: a lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import transerve

SOURCE = Path(transerve.__file__).parent

#: Which packages each package may import (besides itself). `version` is `transerve/__init__.py` (`__version__`).
ALLOWED: dict[str, set[str]] = {
    "version": set(),
    "core": set(),
    "config": {"core"},
    "repository": {"core", "config"},
    "backends": {"core", "config", "repository"},
    "scheduling": {"core", "config", "repository", "backends"},
    "server": {"version", "core", "config", "repository", "backends", "scheduling"},
    "frontends": {"version", "core", "config", "repository", "server"},
    "export": {"core", "config"},
    "convert": {"core", "config", "export"},
    "perf": set(),  # a client of the server, over the network only
    "client": set(),  # likewise
    "ray": {"core"},  # Ray Serve replicas run `transerve serve` as a child process: nothing of the server
    "cli": {"version", "core", "config", "server", "frontends", "export", "convert", "scheduling", "perf", "client",
            "ray"},
    "__main__": {"cli", "core"},  # core: Ctrl-C held while the command loads (core/interrupts.py)
}

#: The only backend modules the schedulers may import: the contract they drive instances through.
SCHEDULING_MAY_IMPORT_FROM_BACKENDS = {"transerve.backends.base"}


def package_of(module: str) -> str:
    parts = module.split(".")
    return "version" if len(parts) == 1 else parts[1]


def module_name(path: Path) -> str:
    relative = path.relative_to(SOURCE.parent).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """The transerve modules `path` imports, relative imports resolved."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                found.add(node.module)
    return {name for name in found if name == "transerve" or name.startswith("transerve.")}


def package_imports() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> the imports, as "module -> module"."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(SOURCE.rglob("*.py")):
        module = module_name(path)
        for imported in imports_of(path):
            if package_of(imported) != package_of(module):
                edges.setdefault((package_of(module), package_of(imported)), []).append(f"{module} -> {imported}")
    return edges


def test_every_package_is_placed_in_a_layer():
    packages = {package_of(module_name(path)) for path in SOURCE.rglob("*.py")}
    assert packages <= ALLOWED.keys(), f"packages without a layer: {sorted(packages - ALLOWED.keys())}"


def test_packages_import_only_the_layers_below_them():
    wrong = [line for (importer, imported), lines in package_imports().items()
             if imported not in ALLOWED.get(importer, set()) for line in lines]
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_the_schedulers_drive_backends_only_through_their_contract():
    lines = package_imports().get(("scheduling", "backends"), [])
    wrong = [line for line in lines if line.split(" -> ")[1] not in SCHEDULING_MAY_IMPORT_FROM_BACKENDS]
    assert not wrong, "\n".join(wrong)


def test_no_cycle_between_packages():
    graph: dict[str, set[str]] = {}
    for importer, imported in package_imports():
        graph.setdefault(importer, set()).add(imported)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for following in graph.get(start, ()):
            if following == goal or (following not in seen and reaches(following, goal, seen | {following})):
                return True
        return False

    cycles = sorted(package for package in graph if reaches(package, package, {package}))
    assert not cycles, f"packages in an import cycle: {cycles}"
