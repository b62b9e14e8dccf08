"""``runtime`` is a library of its own: nothing under it imports Django or the web app."""

import ast
import subprocess
import sys
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"
FORBIDDEN = ("django", "webapp", "rest_framework", "channels", "celery")


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_runtime_module_imports_the_web_stack():
    offenders = {
        str(path.relative_to(RUNTIME.parent)): sorted(
            name for name in _imported_modules(path) if name.split(".")[0] in FORBIDDEN
        )
        for path in RUNTIME.rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_importing_the_runtime_loads_no_django():
    code = (
        "import sys, runtime.engine.slots, runtime.jobs.driver, runtime.events;"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=RUNTIME.parent,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
