"""Shared fixtures. The anyio backend under test comes from $ASYNCSESS_ANYIO_BACKEND (asyncio|trio).

Suites whose dependencies are absent are not collected at all (the nox session that installs them
runs them), so a torch-free run reports no skips: see ``noxfile.py`` for which session runs what.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

# test path (relative to tests/) -> modules it needs
_NEEDS = {
    "local": ("torch", "asyncsess_local"),
    "sagemaker": ("boto3", "asyncsess_sagemaker"),
    "sagemaker/test_official_sdk.py": ("sagemaker.train",),
    "client/test_custom_loss.py": ("torch",),
    "compat/test_doc_snippets_torch.py": ("torch",),
    "local/test_vllm_sampler.py": ("vllm",),
    "compat/test_bad_input_local.py": ("torch", "asyncsess_local"),
    "agent/test_agents_sdk.py": ("agents",),  # openai-agents (the `agents` extra; the mock matrix installs it)
    "agent/test_chat_markup_local.py": ("torch", "asyncsess_local", "transformers", "tokenizers"),
    "compat/test_topk_local.py": ("torch", "asyncsess_local"),
    "compat/test_bad_input_sagemaker.py": ("boto3", "asyncsess_sagemaker"),
    "compat/test_matrix.py": ("tinker", "sagemaker.train"),
    "tinker": ("tinker", "asyncsess_tinker", "fastapi", "uvicorn", "zstandard"),
    "tinker/test_cookbook.py": ("tinker_cookbook",),
    "tinker/test_cookbook_local.py": ("tinker_cookbook",),
    "tinker/test_cookbook_port.py": ("tinker_cookbook",),
    "tinker/test_cookbook_recipes.py": ("tinker_cookbook", "chz"),
    "tinker/test_official_sdk_local.py": ("torch", "asyncsess_local"),
}
_HERE = Path(__file__).parent

# Property-based tests draw the same examples on every run, so that a CI gate never depends on luck;
# ASYNCSESS_FUZZ_RANDOM=1 draws new ones each run, to explore (ASYNCSESS_FUZZ_EXAMPLES scales the fuzz suites).
if importlib.util.find_spec("hypothesis") is not None:
    from hypothesis import settings as _hypothesis

    _hypothesis.register_profile("repeatable", derandomize=True)
    _hypothesis.register_profile("explore", derandomize=False)
    _hypothesis.load_profile("explore" if os.environ.get("ASYNCSESS_FUZZ_RANDOM") == "1" else "repeatable")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent is absent
        return False


def _missing(modules: tuple[str, ...]) -> bool:
    return not all(_installed(m) for m in modules)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    try:
        rel = collection_path.relative_to(_HERE).as_posix()
    except ValueError:
        return None
    for prefix, modules in _NEEDS.items():
        if (rel == prefix or rel.startswith(prefix + "/")) and _missing(modules):
            return True
    return None


# suites that exercise the OS (subprocesses, namespaces, limits) rather than the Python version: the mock matrix
# runs them on one Python, under both anyio backends (marker `once`, see noxfile.py)
_ONCE = ("sandbox/", "code_rl/")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        rel = item.path.relative_to(_HERE).as_posix() if item.path.is_relative_to(_HERE) else ""
        if rel.startswith(_ONCE):
            item.add_marker(pytest.mark.once)


@pytest.fixture(params=[os.environ.get("ASYNCSESS_ANYIO_BACKEND", "asyncio")])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session", autouse=True)
def no_session_left_open():
    """After the whole suite, no mock:// session may still be open (leaks fail the run)."""
    yield
    if importlib.util.find_spec("asyncsess_mock") is None:
        return
    from asyncsess_mock import MockBackend

    leaked = MockBackend.open_sessions()
    assert not leaked, f"sessions left open by the test suite: {leaked}"
