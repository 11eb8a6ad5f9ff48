"""`import asyncsess` stays light: no torch, transformers, vllm or boto3 (checked in a fresh interpreter)."""

import subprocess
import sys

HEAVY = ("torch", "transformers", "vllm", "boto3", "botocore", "peft")


def test_importing_the_sdk_loads_no_heavy_dependency():
    code = (
        "import sys, asyncsess, asyncsess.sync, asyncsess.rl.data, asyncsess.sandbox\n"
        "asyncsess.load_backend('mock://')\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_backends_are_found_by_entry_point():
    import asyncsess

    assert "mock" in asyncsess.available_schemes()
