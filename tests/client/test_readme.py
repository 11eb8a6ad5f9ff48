"""The README's API tour runs as written (docs stay true to the code)."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_tour_runs():
    code = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 10 and lines[-1].startswith("9 ")
