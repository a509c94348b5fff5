"""The library's size rules (issue 42): modules at most 600 lines, functions at most 80, and no public function or
public class's constructor with more than 10 parameters (``self``/``cls``, ``*args`` and ``**kwargs`` not counted;
many settings are a dataclass the caller passes, as ``NonForgettingConfig`` or ``StepConfig``, whose fields are no
function's parameters). Read from the source with ``ast``, so a rule broken anywhere in ``hf_constrained/`` names
the place."""

from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_PUBLIC_PARAMETERS = 600, 80, 10


def library_files() -> list[str]:
    root = os.path.join(REPO, "hf_constrained")
    return sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".py"))


def parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return len(names) - (1 if names and names[0] in ("self", "cls") else 0)


def size_problems(path: str) -> list[str]:
    """Every rule ``path`` breaks, one line each (``file:line name: what``)."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    where = os.path.relpath(path, REPO)
    out = []
    if len(source.splitlines()) > MAX_MODULE_LINES:
        out.append(f"{where}: {len(source.splitlines())} lines")
    tree = ast.parse(source)
    public_inits = {id(b) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and not c.name.startswith("_")
                    for b in c.body if isinstance(b, ast.FunctionDef) and b.name == "__init__"}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        length = node.end_lineno - node.lineno + 1
        if length > MAX_FUNCTION_LINES:
            out.append(f"{where}:{node.lineno} {node.name}: {length} lines")
        public = not node.name.startswith("_") or id(node) in public_inits
        if public and parameters(node) > MAX_PUBLIC_PARAMETERS:
            out.append(f"{where}:{node.lineno} {node.name}: {parameters(node)} parameters")
    return out


def test_the_checker_finds_each_rule(tmp_path):
    long_body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    path = tmp_path / "m.py"
    path.write_text(f"def long():\n{long_body}\n\n"
                    "def wide(a, b, c, d, e, f, g, h, i, j, k):\n    pass\n\n"
                    "def _private_wide(a, b, c, d, e, f, g, h, i, j, k):\n    pass\n\n"
                    "class Public:\n    def __init__(self, a, b, c, d, e, f, g, h, i, j, k):\n        pass\n\n"
                    "class Fine:\n    def __init__(self, a, b, c, d, e, f, g, h, i, j, *args, **kwargs):\n"
                    "        pass\n")
    found = size_problems(str(path))
    assert [p.split(" ", 1)[1] for p in found] == ["long: 81 lines", "wide: 11 parameters",
                                                   "__init__: 11 parameters"], found


def test_library_modules_and_functions_stay_small():
    problems = [p for path in library_files() for p in size_problems(path)]
    assert not problems, "split by idea (docs/architecture.md), not to meet the number:\n" + "\n".join(problems)


def test_recipes_functions_stay_small_and_the_demo_thin():
    """The recipes are commands over the library (issue 42, "thin recipes"): their functions follow the library's
    rules, and the demo, the first recipe a user reads, stays at most 500 lines."""
    root = os.path.join(REPO, "recipes")
    paths = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".py"))
    # a function's rule ("file:line name: ..."), not the module's length ("file: N lines")
    problems = [p for path in paths for p in size_problems(path) if not p.split(" ")[0].endswith(":")]
    assert not problems, "\n".join(problems)
    with open(os.path.join(root, "demo_clip_digits.py"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) <= 500
