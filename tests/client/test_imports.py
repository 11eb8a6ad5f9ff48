"""`import asyncsess` stays light: no torch, transformers, vllm or boto3 (checked in a fresh interpreter), and
the ``http://`` driver for a remote worker comes with the core (the mock matrix has no torch installed; a real
round trip from a torch-blocked process is tests/local/test_http_driver_without_torch.py)."""

import subprocess
import sys

HEAVY = ("torch", "transformers", "vllm", "boto3", "botocore", "peft")


def test_importing_the_sdk_loads_no_heavy_dependency():
    code = (
        "import sys, asyncsess, asyncsess.sync, asyncsess.rl.data, asyncsess.sandbox\n"
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
