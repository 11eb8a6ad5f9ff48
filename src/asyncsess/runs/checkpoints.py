"""A run directory: ``config.json``, ``checkpoints.jsonl`` (one record per checkpoint) and resume.

Resume follows tinker-cookbook: read the last record that has a ``state_path``, reopen the session
with ``create_training_client_from_state_with_optimizer`` and restart the loop at the record's step.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, TypeVar

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..backends.registry import check_url
from ..client import ServiceClient, TrainingClient
from ..errors import DeadlineExceededError, InvalidInputError, PoisonedError, RetriesExhaustedError, SessionGoneError
from ..retry import RetryPolicy
from .jsonl import JsonlLine, json_data, open_for_append, read_jsonl, refuse, write_whole
from .metrics import METRICS_FILE, read_metrics

__all__ = [
    "CHECKPOINTS_FILE",
    "CONFIG_FILE",
    "CheckpointRecord",
    "parse_overrides",
    "open_run_dir",
    "prepare_run_dir",
    "save_checkpoint",
    "last_checkpoint",
    "read_checkpoints",
    "read_run_config",
    "reopen_training_client",
    "RecoveryConfig",
    "run_recovering",
    "wait_for_backend",
]

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup
try:
    import fcntl
except ImportError:  # Windows: run directories are not locked
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("asyncsess.runs.checkpoints")
T = TypeVar("T")
IfExists = Literal["resume", "overwrite", "raise"]

CHECKPOINTS_FILE = "checkpoints.jsonl"
CONFIG_FILE = "config.json"


MAX_STEP = 2**53  # an optimizer-step count; more is not a run's


class CheckpointRecord(BaseModel):
    """One line of ``checkpoints.jsonl``. ``step`` is the number of optimizer steps the state holds."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)

    name: str
    step: int = Field(ge=0, le=MAX_STEP)
    final: bool = False
    state_path: str | None = None
    sampler_path: str | None = None
    time: float = Field(default_factory=time.time)
    extra: dict[str, Any] = Field(default_factory=dict)


def parse_overrides(args: Sequence[str]) -> dict[str, Any]:
    """``["max_steps=20", "url=local://", 'loss_fn_config={"clip_low_threshold": 0.8}']`` as a dict
    (values parsed as JSON where they are JSON, else kept as strings); a config validates them."""
    out: dict[str, Any] = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise InvalidInputError(f"{arg!r} is not key=value", field="args", fix="e.g. max_steps=20")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def prepare_run_dir(
    run_dir: str | Path, config: BaseModel, if_exists: Literal["resume", "overwrite", "raise"] = "resume"
) -> tuple[Path, CheckpointRecord | None]:
    """Create ``run_dir`` and write ``config.json``; return the checkpoint to resume from, if any.

    An existing directory is resumed (its config must match), emptied (``overwrite``; only a run's directory,
    one that holds ``config.json``) or refused (``raise``). A config whose ``url`` no installed backend serves
    is refused first, leaving the directory as it was; so is a ``checkpoints.jsonl`` or ``config.json`` that
    does not hold what a run writes there. A loop holds the directory while it runs: :func:`open_run_dir`.
    """
    path, cfg = _checked(run_dir, config, if_exists)
    with _usable(path):
        return _prepare(path, cfg, if_exists)


@contextmanager
def open_run_dir(
    run_dir: str | Path, config: BaseModel, if_exists: Literal["resume", "overwrite", "raise"] = "resume"
) -> Iterator[tuple[Path, CheckpointRecord | None]]:
    """:func:`prepare_run_dir`, holding the directory (an exclusive ``flock`` on it) until the block ends, so
    that a second run on it, in this process or another, is refused (``InvalidInputError`` naming ``run_dir``)
    before it reads or writes anything, instead of interleaving its records with the first's. The lock goes
    with the process: a killed run leaves none behind. (Where ``fcntl`` is missing, Windows, nothing is locked.)"""
    path, cfg = _checked(run_dir, config, if_exists)
    with _usable(path):
        path.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        with _usable(path):
            prepared = _prepare(path, cfg, if_exists)
        yield prepared


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on the directory ``path`` for the block (nothing where ``fcntl`` is missing)."""
    if fcntl is None:
        yield
        return
    with _usable(path):
        fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InvalidInputError(
                f"{path} is in use by another run (in this process or another)",
                field="run_dir",
                fix="wait for that run to end (or stop it), or pick another run directory",
            ) from None
        yield
    finally:
        os.close(fd)  # and with it the lock


def _checked(run_dir: str | Path, config: BaseModel, if_exists: str) -> tuple[Path, dict[str, Any]]:
    """The run directory's path and the config as JSON data, once the arguments are checked."""
    if if_exists not in ("resume", "overwrite", "raise"):
        raise InvalidInputError(f"{if_exists!r:.40} is not a choice", field="if_exists", fix="pass 'resume', 'overwrite' or 'raise'")
    if isinstance(url := getattr(config, "url", None), str):
        check_url(url)
    if str(run_dir).strip() == "":  # Path("") is the working directory: run files would land among the user's
        raise InvalidInputError("is empty", field="run_dir", fix="name a directory, e.g. runs/my_run")
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise InvalidInputError(f"{path} is a file, not a directory", field="run_dir", fix="pass a directory path (new or a run's)")
    return path, json.loads(config.model_dump_json())


@contextmanager
def _usable(path: Path) -> Iterator[None]:
    """An OSError in the block (a parent that is a file, no permission, a read-only or full disk) as a typed error."""
    try:
        yield
    except OSError as err:
        raise InvalidInputError(
            f"{path} cannot be used as a run directory ({err.strerror or err})",
            field="run_dir",
            fix="pass a directory this process can write",
        ) from None


def _prepare(path: Path, cfg: dict[str, Any], if_exists: IfExists) -> tuple[Path, CheckpointRecord | None]:
    """:func:`prepare_run_dir` once its arguments are checked."""
    record = None
    if path.exists() and any(path.iterdir()):
        if if_exists == "raise":
            raise InvalidInputError(f"{path} is not empty", field="run_dir", fix="pick a new directory, or resume/overwrite it")
        old = read_run_config(path)
        if old is None and any((path / name).exists() for name in (CHECKPOINTS_FILE, METRICS_FILE)):
            raise InvalidInputError(
                f"{path} holds run files but no {CONFIG_FILE}", field="run_dir", fix="use a new run directory (or restore its config.json)"
            )
        if if_exists == "overwrite":
            if old is None:
                raise InvalidInputError(
                    f"{path} is not a run directory (it has no {CONFIG_FILE}); overwrite would delete what it holds",
                    field="run_dir",
                    fix="pick a new or empty directory, or a run directory",
                )
            _empty(path)
        else:
            if old is not None and _comparable(old) != _comparable(cfg):
                raise InvalidInputError(
                    f"{path} holds a run with a different config", field="run_dir", fix="use a new run directory or the same settings"
                )
            record = last_checkpoint(path)
    path.mkdir(parents=True, exist_ok=True)
    write_whole(path / CONFIG_FILE, json.dumps(cfg, indent=2) + "\n")  # a kill never leaves half a config
    return path, record


def read_run_config(path: Path) -> dict[str, Any] | None:
    """The ``config.json`` of the run in ``path`` (``None`` if it has none); a typed error if it is not one."""
    file = path / CONFIG_FILE
    if not file.exists() and not file.is_symlink():
        return None
    fix = f"use a new run directory (its {CONFIG_FILE} is not one asyncsess wrote)"
    try:
        value = json.loads(file.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as err:
        raise refuse(file, None, None, f"is not a config ({type(err).__name__}: {str(err)[:80]})", fix) from None
    if not isinstance(value, dict):
        raise refuse(file, None, None, f"holds a JSON {type(value).__name__}, not an object", fix)
    return value


def _empty(path: Path) -> None:
    """Remove what ``path`` holds (the directory itself stays: it may be a mount point or a link's target)."""
    for entry in path.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _comparable(cfg: dict[str, Any]) -> dict[str, Any]:
    """Settings that may change between a run and its resumption: how long it runs."""
    return {k: v for k, v in cfg.items() if k not in ("max_steps", "max_minutes", *RecoveryConfig.model_fields)}


async def save_checkpoint(
    tc: TrainingClient,
    run_dir: str | Path,
    name: str,
    step: int,
    kind: Literal["state", "sampler", "both"] = "state",
    final: bool = False,
    extra: dict[str, Any] | None = None,
) -> CheckpointRecord:
    """Save the session (``state``: weights + optimizer, resumable; ``sampler``: weights) and append a record.
    A ``checkpoints.jsonl`` with a line that is not a record is refused first (nothing is saved)."""
    file = Path(run_dir) / CHECKPOINTS_FILE
    read_checkpoints(run_dir)  # never bury a bad line under new ones
    extra = json_data(dict(extra or {}), "extra", "extra")  # numpy values as numbers; anything else refused before saving
    state = tc.save_state(name) if kind in ("state", "both") else None
    sampler = tc.save_weights_for_sampler(name) if kind in ("sampler", "both") else None
    record = CheckpointRecord(
        name=name,
        step=step,
        final=final,
        state_path=(await state).path if state else None,
        sampler_path=(await sampler).path if sampler else None,
        extra=extra,
    )
    with open_for_append(file, lambda n, r: _record(file, n, r), _FIX) as f:
        f.write(record.model_dump_json() + "\n")
    return record


_FIX = "start a new run directory, or cut checkpoints.jsonl back to its last good line"


def _record(file: Path, line: int, raw: dict[str, Any]) -> CheckpointRecord:
    try:
        return CheckpointRecord.model_validate(raw)
    except ValidationError as err:
        e = err.errors(include_url=False)[0]
        raise refuse(file, line, ".".join(map(str, e["loc"])) or None, e["msg"], _FIX) from None


def read_checkpoints(run_dir: str | Path) -> list[CheckpointRecord]:
    """The records of ``checkpoints.jsonl`` (a torn last line, left by a killed process, aside); a typed error
    naming the line and field for any other line that is not a record, or whose step is below the one before."""
    file = Path(run_dir) / CHECKPOINTS_FILE
    lines: list[JsonlLine] = read_jsonl(file, lambda n, r: _record(file, n, r), _FIX)
    records: list[CheckpointRecord] = []
    for n, raw in lines:
        record = _record(file, n, raw)
        if records and record.step < records[-1].step:
            raise refuse(file, n, "step", f"step {record.step} comes after step {records[-1].step}", _FIX)
        records.append(record)
    return records


def last_checkpoint(run_dir: str | Path, required_key: str = "state_path") -> CheckpointRecord | None:
    """The last record of ``checkpoints.jsonl`` whose ``required_key`` is set (see :func:`read_checkpoints`)."""
    usable = [r for r in read_checkpoints(run_dir) if getattr(r, required_key) is not None]
    return usable[-1] if usable else None


async def open_training_client(svc: ServiceClient, cfg: Any, record: CheckpointRecord | None) -> TrainingClient:
    """Resume exactly from ``record`` (weights and optimizer), or start a LoRA client from ``cfg``'s
    ``base_model``, ``lora_rank``, ``lora_alpha``, ``seed`` and ``train_unembed``."""
    if record is not None:
        return await reopen_training_client(svc, record)
    return await svc.create_lora_training_client(
        cfg.base_model, rank=cfg.lora_rank, alpha=cfg.lora_alpha, seed=cfg.seed, train_unembed=cfg.train_unembed
    )


async def reopen_training_client(svc: ServiceClient, record: CheckpointRecord) -> TrainingClient:
    """The session saved at ``record`` (weights and optimizer). A checkpoint the backend cannot open (its files
    deleted or cut short, a path of another backend) is an :class:`InvalidInputError` naming the record of
    ``checkpoints.jsonl`` and the fix, with the backend's error as its cause."""
    if record.state_path is None:
        raise InvalidInputError("the last checkpoint record has no state_path", field="checkpoints.jsonl", fix="start a new run")
    try:
        return await svc.create_training_client_from_state_with_optimizer(record.state_path)
    except InvalidInputError as err:  # NotFoundError included
        why = err.message.removesuffix(f" (fix: {err.fix})") if err.fix else err.message
        raise InvalidInputError(
            f"the checkpoint {record.name!r:.80} (step {record.step}) cannot be opened: {why}",
            field=f"{CHECKPOINTS_FILE}.state_path",
            fix=f"restore its files, or cut {CHECKPOINTS_FILE} back to the last record whose checkpoint the backend still has "
            "(that run resumes from there), or start a new run directory",
        ) from err


class RecoveryConfig(BaseModel):
    """How a loop survives the loss of its session or backend (a killed worker, an expired session).

    On such a loss the loop waits up to ``recovery_wait_s`` for the backend to answer again, reopens the
    session from the last record of ``checkpoints.jsonl`` (weights, optimizer state, data position) and goes
    on; it does this at most ``max_recoveries`` times. A recovery redoes at most the steps since that
    checkpoint: ``save_every`` of them (every step so far when ``save_every`` is 0).
    """

    max_recoveries: int = Field(default=3, ge=0)
    recovery_wait_s: float = Field(default=300.0, gt=0, allow_inf_nan=False)


def session_lost(err: BaseException) -> bool:
    """Whether ``err`` (or, in an exception group, every leaf of it) means the session or backend is gone."""
    if isinstance(err, BaseExceptionGroup):
        return all(session_lost(e) for e in err.exceptions)
    if isinstance(err, PoisonedError):
        return err.cause is not None and session_lost(err.cause)
    return isinstance(err, (SessionGoneError, RetriesExhaustedError, DeadlineExceededError))


async def wait_for_backend(url: str, wait_s: float) -> float:
    """Probe ``url`` until it answers (``get_server_capabilities``); return the seconds waited.

    Raises ``DeadlineExceededError`` when it has not answered within ``wait_s``.
    """
    t0 = anyio.current_time()
    deadline = t0 + wait_s
    pause = 0.05
    while True:
        remaining = deadline - anyio.current_time()
        try:
            policy = RetryPolicy(max_attempts=1, attempt_timeout=max(min(remaining, 10.0), 0.01), deadline=None)
            async with ServiceClient(url, retry=policy, heartbeat_interval=0) as svc:
                await svc.get_server_capabilities()
            return anyio.current_time() - t0
        except Exception as err:
            if anyio.current_time() + pause >= deadline:
                raise DeadlineExceededError(f"the backend at {url} did not come back within {wait_s:g}s: {err!r}") from err
            log.info("backend %s not back yet (%r); next probe in %.2fs", url, err, pause)
        await anyio.sleep(pause)
        pause = min(pause * 2, 5.0)


async def run_recovering(
    attempt: Callable[[IfExists, dict[str, float]], Awaitable[T]],
    if_exists: IfExists,
    *,
    url: str,
    run_dir: str | Path,
    recovery: RecoveryConfig,
) -> T:
    """Run a loop (``attempt(if_exists, recovery_metrics)``); when its session is lost, wait for the
    backend and run it again in ``resume`` mode, handing it the metrics to log on its first step."""
    recoveries = 0
    mode: IfExists = if_exists
    metrics: dict[str, float] = {}
    while True:
        try:
            return await attempt(mode, metrics)
        except Exception as err:
            if recoveries >= recovery.max_recoveries or not session_lost(err):
                raise
            recoveries += 1
            done = _steps_logged(run_dir)
            record = last_checkpoint(run_dir)
            resume_at = record.step if record else 0
            log.warning("session lost at step %d (%r); recovery %d from the checkpoint at step %d", done, err, recoveries, resume_at)
            waited = await wait_for_backend(url, recovery.recovery_wait_s)
            mode = "resume"
            metrics = {
                "recovery/count": float(recoveries),
                "recovery/lost_steps": float(max(done - resume_at, 0)),
                "recovery/wait_s": waited,
            }


def _steps_logged(run_dir: str | Path) -> int:
    """How many steps ``metrics.jsonl`` records as done (the closing evaluation line aside)."""
    path = Path(run_dir)
    if not (path / METRICS_FILE).exists():
        return 0
    return max((r["step"] for r in read_metrics(path) if "progress/step" not in r), default=-1) + 1
