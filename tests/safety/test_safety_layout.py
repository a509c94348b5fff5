"""Package layout: every module imports alone, no import cycles, a light command line.

The import graph is read from the source (``ast``): every ``import`` anywhere in a module,
function bodies and ``if TYPE_CHECKING:`` blocks included (a function-local import that dodges a
cycle is still a cycle, and a type-only import is a dependency of the reader), except under
``if __name__ == "__main__":`` (runs only when the file is executed as a script, as ``__main__``,
not as the package module). The lazy name tables (``_LAZY``) of package ``__init__`` files count as
imports too.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "hf_constrained"


def package_modules() -> dict[str, str]:
    """module name -> file, for every ``.py`` file of the package's (regular) packages; files in
    folders without ``__init__.py`` are resources, not modules."""
    out = {}
    root = os.path.join(REPO, PACKAGE)
    for directory, _, files in os.walk(root):
        if "__init__.py" not in files:
            continue
        for f in files:
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(directory, f), REPO)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(rel)] = os.path.join(directory, f)
    return out


def _skipped_block(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators))


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports_of(module: str, path: str, modules: dict[str, str]) -> set[str]:
    """The package modules that ``module`` imports (see the module docstring)."""
    is_package = path.endswith("__init__.py")
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    found: set[str] = set()

    def add(target: str) -> None:
        # "a.b.c" may name a module, or a name inside module "a.b"
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != module:
            found.add(target)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _skipped_block(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module) if node.level else (node.module or "")
            if base.split(".")[0] == PACKAGE:
                for alias in node.names:
                    add(f"{base}.{alias.name}")
        elif (isinstance(node, ast.Assign) and is_package and isinstance(node.value, ast.Dict)
              and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets)):
            for value in node.value.values:  # "_LAZY = {name: module}": imported on first access
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    rel = value.value
                    level = len(rel) - len(rel.lstrip("."))
                    add(_resolve(module, True, level, rel.lstrip(".")) if level else f"{module}.{rel}")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes (first == last), or ``None``."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = dfs(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = dfs(node)
            if cycle:
                return cycle
    return None


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def test_cycle_check_finds_cycles():
    """The checker itself: a cycle through a function-local or a type-only import is found, a DAG passes."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    modules = {"hf_constrained": "", "hf_constrained.x": "", "hf_constrained.y": "", "hf_constrained.z": "",
               "hf_constrained.w": ""}
    src = ("def f():\n    from . import y\nif TYPE_CHECKING:\n    from .z import q\n"
           "if __name__ == '__main__':\n    from . import w\n")
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"hfc_layout_{os.getpid()}.py")
    with open(path, "w") as f:
        f.write(src)
    try:
        assert imports_of("hf_constrained.x", path, modules) == {"hf_constrained.y", "hf_constrained.z"}
    finally:
        os.remove(path)


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    assert "hf_constrained.safety.loop" in graph["hf_constrained.trainer"]  # the graph sees real edges
    # a type-only import (under TYPE_CHECKING) is an edge too
    assert "hf_constrained.method.shared_forward" in graph["hf_constrained.method.draw_values"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _package(graph: dict[str, set[str]], name: str) -> list[str]:
    modules = [m for m in graph if m == name or m.startswith(name + ".")]
    assert modules, name
    return modules


def _imports_of_package(graph: dict[str, set[str]], name: str) -> set[str]:
    return {d for m in _package(graph, name) for d in graph[m]}


def _within(deps: set[str], packages: tuple[str, ...]) -> set[str]:
    return {d for d in deps if any(d == p or d.startswith(p + ".") for p in packages)}


def test_packages_are_layered_one_way():
    """certification (statistics, no model) <- publishing (report, card, figures, push) <- safety (the loop the
    trainer holds) <- trainer <- command line and recipes; the user's problem (``constraint``) below the method."""
    graph = import_graph()
    assert "hf_constrained.certification.certify" in graph["hf_constrained.publishing.report"]  # real edges seen
    # publishing reads reports and files: never the run's glue, the trainer, the method or the recipes
    publishing = _imports_of_package(graph, "hf_constrained.publishing")
    assert not _within(publishing, ("hf_constrained.safety", "hf_constrained.trainer", "hf_constrained.method",
                                    "hf_constrained.constraint", "hf_constrained.cli", "hf_constrained.recipes"))
    # the safety loop: never the trainer, the command line or the recipes
    safety = _imports_of_package(graph, "hf_constrained.safety")
    assert not _within(safety, ("hf_constrained.trainer", "hf_constrained.cli", "hf_constrained.recipes"))
    # the report is plain data: the stdlib-only atomic writes, the certificate and its own text
    assert graph["hf_constrained.publishing.report"] <= {"hf_constrained.atomic_files",
                                                         "hf_constrained.certification.certify",
                                                         "hf_constrained.publishing.tables"}
    assert graph["hf_constrained.atomic_files"] == set()
    assert graph["hf_constrained.certification.selection"] == set()
    # the user's problem imports nothing of the method; non-forgetting nothing of the run's glue
    assert not _within(graph["hf_constrained.constraint"], ("hf_constrained.method",))
    assert not _within(graph["hf_constrained.non_forgetting"], ("hf_constrained.safety", "hf_constrained.trainer"))
    # the reference pass (the old model's values, computed once) needs rows and a model, nothing of the run
    assert graph["hf_constrained.reference_pass"] <= {"hf_constrained.batches"}
    # the library never imports the command line
    assert not [m for m, deps in graph.items() if "hf_constrained.cli" in deps and m != "hf_constrained.cli"]


def _fresh(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=120)


def third_party_imports() -> list[tuple[str, list[str]]]:
    """(module, names imported from it) for every module outside the package that the package
    imports when its modules are imported; the names matter: ``from transformers import Trainer``
    loads a lazy submodule."""
    found: dict[str, set[str]] = {}

    def module_level(node: ast.AST):  # what runs at import: not function bodies
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from module_level(child)

    for path in package_modules().values():
        for node in module_level(ast.parse(open(path, encoding="utf-8").read(), path)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    found.setdefault(alias.name, set())
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.setdefault(node.module, set()).update(a.name for a in node.names)
    return sorted((m, sorted(names)) for m, names in found.items() if m.split(".")[0] != PACKAGE)


@pytest.mark.slow
def test_every_module_imports_alone_in_a_fresh_interpreter():
    """Each module is imported first, alone, in a process where no module of the package
    was imported before (so import order cannot hide a cycle). To keep this fast, one parent
    process loads the third-party libraries once (torch, transformers, ...: never the package)
    and forks a child per module."""
    modules = sorted(package_modules())
    code = (
        "import importlib, os, sys\n"
        f"for name, attributes in {third_party_imports()!r}:\n"
        "    try:\n"
        "        module = importlib.import_module(name)\n"
        "        for attribute in attributes: getattr(module, attribute, None)\n"
        "    except Exception: pass\n"
        f"assert not [m for m in sys.modules if m.split('.')[0] == {PACKAGE!r}]\n"
        "bad = []\n"
        f"for m in {modules!r}:\n"
        "    r, w = os.pipe()\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        os.close(r)\n"
        "        try:\n"
        "            importlib.import_module(m)\n"
        "            os._exit(0)\n"
        "        except BaseException as exc:\n"
        "            os.write(w, repr(exc).encode()[:2000])\n"
        "            os._exit(1)\n"
        "    os.close(w)\n"
        "    message = os.read(r, 4000).decode()\n"
        "    os.close(r)\n"
        "    if os.waitpid(pid, 0)[1] != 0: bad.append((m, message))\n"
        "print(len(" + repr(modules) + "), bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    result = _fresh(code)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith(f"{len(modules)} []")


def test_command_line_and_report_do_not_load_the_trainer():
    """``hf-constrained --help`` / ``report`` import no torch and no transformers."""
    result = _fresh("import sys, hf_constrained, hf_constrained.cli, hf_constrained.recipes, "
                    "hf_constrained.publishing.report\n"
                    "import contextlib, io\n"
                    "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
                    "    hf_constrained.cli.main(['--help'])\n"
                    "print(sorted(m for m in ('torch', 'transformers', 'transformers.trainer', 'matplotlib.pyplot')"
                    " if m in sys.modules))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("name", ["SafetyReport", "UnsafeModelError", "build_safety_report", "finish_run",
                                  "ConstrainedTrainer", "Constraint"])
def test_top_level_names_still_import(name):
    import hf_constrained

    assert getattr(hf_constrained, name).__name__ == name
    assert name in hf_constrained.__all__


def test_top_level_all_matches_lazy_table():
    """``__all__`` is written out literally (so linters see the re-exports); it must list exactly the lazy names."""
    import hf_constrained

    assert sorted(hf_constrained.__all__) == sorted(hf_constrained._LAZY)
    assert hf_constrained.__all__ == sorted(hf_constrained.__all__)
