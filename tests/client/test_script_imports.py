"""The scripts outside the package (bench/, examples/, scripts/) import only names that asyncsess still has.

They run rarely (benchmarks on demand), so a rename inside the package would otherwise rot them silently:
bench/bench_trl.py once imported ``Problem`` from a module that no longer held it.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for d in ("bench", "examples", "scripts") for p in (ROOT / d).rglob("*.py"))


def asyncsess_imports(path: Path) -> list[tuple[str, str]]:
    """``(module, name)`` for every ``from asyncsess... import name`` in ``path``, at any depth, except the
    fallbacks in an ``except ImportError`` handler (a bench that also runs against older commits)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    fallbacks = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for h in t.handlers for n in ast.walk(h)}
    found = []
    for node in ast.walk(tree):
        if (
            id(node) not in fallbacks
            and isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.split(".")[0] == "asyncsess"
        ):
            found += [(node.module, a.name) for a in node.names if a.name != "*"]
    return found


def test_the_scripts_are_found() -> None:
    names = {p.name for p in SCRIPTS}
    assert {"bench_trl.py", "trl_grpo_child.py", "math_rl.py"} <= names


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_asyncsess_name_a_script_imports_exists(path: Path) -> None:
    missing = []
    for module, name in asyncsess_imports(path):
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{module}.{name}")
    assert not missing, f"{path.relative_to(ROOT)} imports names asyncsess no longer has: {missing}"
