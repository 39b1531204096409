"""The code's layers point one way: ``kernels`` (installed as ``ringflash.kernels``) imports
nothing of the distributed layer, and no module of either imports, at module level or inside a
function, a module that imports it back (entry points -> custom ops -> engines)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"ringflash": ROOT / "ringflash", "ringflash.kernels": ROOT / "kernels"}


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports anywhere in its file (relative imports: ours)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.ImportFrom) and node.level):
            continue
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
        for candidate in [target] + [f"{target}.{a.name}" for a in node.names]:
            if candidate in modules:
                found.add(candidate)
    return found


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def test_kernels_import_nothing_of_the_distributed_layer():
    modules = _modules()
    for name, path in modules.items():
        if name.startswith("ringflash.kernels"):
            outside = {m for m in _imports(name, path, modules) if not m.startswith("ringflash.kernels")}
            assert not outside, f"{name} imports {outside}"


def test_no_import_cycles():
    modules = _modules()
    # Packages' __init__ re-export their modules; the cycles that matter run between modules.
    graph = {
        n: {m for m in _imports(n, p, modules) if not _is_package(m, modules)}
        for n, p in modules.items()
        if not _is_package(n, modules)
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            assert state.get(dep) != 1, "import cycle: " + " -> ".join(path[path.index(dep) :] + [dep])
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_the_kernels_folder_loads_once_under_either_name():
    """Run from a checkout's root, ``kernels/`` is also a top-level ``kernels`` package, which
    transformers imports while probing for Hugging Face's kernel hub. That name must give the
    one ``ringflash.kernels``: a second copy re-registers the torch.library ops and leaves the
    first copy's handles dangling (a fake-tensor call under torch.compile then crashed)."""
    import subprocess
    import sys

    script = (
        "import sys, ringflash.kernels as ours, kernels\n"
        "assert kernels is ours, kernels\n"
        "import transformers.modeling_utils\n"
        "copies = sorted(m for m in sys.modules if m.startswith('kernels.'))\n"
        "assert not copies, copies\n"
    )
    command = [sys.executable, "-c", script]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
