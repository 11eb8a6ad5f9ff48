"""`import asyncsess` stays light: no torch, transformers, vllm or boto3 (checked in a fresh interpreter), and
the ``http://`` driver for a remote worker comes with the core (the mock matrix has no torch installed; a real
round trip from a torch-blocked process is tests/local/test_http_driver_without_torch.py)."""

import subprocess
import sys

HEAVY = ("torch", "transformers", "vllm", "boto3", "botocore", "peft", "fastapi", "matplotlib")


def test_importing_the_sdk_loads_no_heavy_dependency():
    code = (
        "import sys, asyncsess, asyncsess.sync, asyncsess.rl, asyncsess.runs, asyncsess.supervised.preference, asyncsess.sandbox\n"
        "asyncsess.load_backend('mock://')\n"
        "assert type(asyncsess.load_backend('http://127.0.0.1:9')).__module__ == 'asyncsess.backends.http'\n"
        "asyncsess.ServiceClient('http://127.0.0.1:9', api_key='k')\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_backends_are_found_by_entry_point():
    import asyncsess

    assert "mock" in asyncsess.available_schemes()


# Layers of src/asyncsess, bottom first: a module may import its own layer and the ones below, never above.
LAYERS = [
    {"errors"},
    {"types"},
    {"validation", "chat", "custom_loss", "batching", "futures", "retry", "sampling"},
    {"backends"},  # the seam: records, registry, sequencer, the http:// driver
    {"client"},
    {"_facade", "sync"},  # the generated blocking facade and its runtime
    {"runs", "sandbox"},
    {"serve"},  # fronts over any client: Tinker wire, OpenAI
    {"rl"},
    {"supervised", "tasks"},
    {"cli", "__main__", "__init__"},
]


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path, module: str, is_package: bool):
    import ast

    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "asyncsess":  # `from asyncsess import x` / `from . import x` at the top: x is the unit
                yield from (f"asyncsess.{a.name}" for a in node.names)
            elif target.startswith("asyncsess."):
                yield target
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("asyncsess."))


def test_no_module_imports_upward():
    from pathlib import Path

    import asyncsess

    rank = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    root = Path(asyncsess.__file__).parent
    upward = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if path.name == "__init__.py" else rel.parts)
        src = _unit(module) if path.name != "__init__.py" or module != "asyncsess" else "__init__"
        assert src in rank, f"{module}: add its unit {src!r} to LAYERS"
        for target in _imports(path, module, path.name == "__init__.py"):
            dst = _unit(target)
            assert dst in rank, f"{target}: add its unit {dst!r} to LAYERS"
            if rank[dst] > rank[src]:
                upward.append(f"{module} -> {target}")
    assert upward == []
