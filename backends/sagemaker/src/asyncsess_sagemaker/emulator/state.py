"""The emulated service's records: sessions, operations, model packages, hub models."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio

from asyncsess.backends.sequencer import Sequencer

__all__ = [
    "ACCEPTS_WORK",
    "STOPPABLE",
    "DELETABLE",
    "TERMINAL",
    "HubModel",
    "OperationRecord",
    "SessionRecord",
    "ModelPackageGroupRecord",
    "ModelPackageRecord",
]

ACCEPTS_WORK = frozenset({"Running", "Blocked"})
STOPPABLE = frozenset({"Created", "Scheduled", "Running", "Blocked"})
DELETABLE = frozenset({"Stopped", "Failed", "Expired", "DeletionFailed"})
TERMINAL = frozenset({"Stopped", "Failed", "Expired", "Deleting", "DeletionFailed"})


@dataclass(frozen=True)
class HubModel:
    """A SageMaker Public Hub entry standing for one model of the inner backend."""

    hub_name: str
    version: str
    model_id: str  # the inner backend's model name, published as the HuggingfaceId
    arn: str
    max_context_length: int
    vocab_size: int | None


@dataclass
class OperationRecord:
    id: str
    kind: str  # the union member: forward, forwardBackward, ..., sample, computeLogprobs, ...
    config: dict[str, Any]
    seq: int | None = None
    client_token: str | None = None
    status: str = "Pending"
    result: dict[str, Any] | None = None
    error_details: str | None = None
    token_usage: dict[str, int] | None = None
    done: anyio.Event = field(default_factory=anyio.Event)

    def finish(self, status: str, *, result: dict[str, Any] | None = None, error: str | None = None) -> None:
        if self.done.is_set():
            return
        self.status, self.result, self.error_details = status, result, error
        self.done.set()

    def output(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.status}
        if self.result is not None:
            out["operationResult"] = {self.kind: self.result}
        if self.error_details is not None:
            out["errorDetails"] = self.error_details
        if self.token_usage is not None:
            out["tokenUsage"] = self.token_usage
        return out


@dataclass
class SessionRecord:
    name: str
    arn: str
    request: dict[str, Any]
    model: HubModel
    group: str
    sequencer: Sequencer[dict[str, Any]]
    status: str = "Created"
    error_details: str | None = None
    inner_id: str | None = None
    created: float = field(default_factory=time.time)
    last_modified: float = field(default_factory=time.time)
    end_time: float | None = None
    last_activity: float = field(default_factory=time.monotonic)
    last_received_seq: int | None = None
    training_ops: dict[str, OperationRecord] = field(default_factory=dict)
    by_seq: dict[int, OperationRecord] = field(default_factory=dict)
    by_token: dict[str, OperationRecord] = field(default_factory=dict)
    refused: set[int] = field(default_factory=set)  # sequence numbers taken by refused ops (their turn runs nothing)
    engine_seq: int = 1  # the number of the next op sent to the inner engine
    sampling_ops: dict[str, OperationRecord] = field(default_factory=dict)
    samplers: dict[str | None, str] = field(default_factory=dict)  # model package ARN (None: base) -> inner sampler id
    sampler_lock: anyio.Lock = field(default_factory=anyio.Lock)  # one engine sampler per ARN, even for concurrent samples
    sampler_uses: Counter[str] = field(default_factory=Counter)  # inner sampler id -> samples running on it
    latest_checkpoint: str | None = None
    gap_watched: int | None = None  # the missing sequence number whose gap timer runs
    prefill_tokens: int = 0
    sample_tokens: int = 0
    training_tokens: int = 0

    def set_status(self, status: str, error: str | None = None) -> None:
        self.status = status
        self.last_modified = time.time()
        if error is not None:
            self.error_details = error[:1024]
        if status in TERMINAL and self.end_time is None:
            self.end_time = self.last_modified

    def pending_training_ops(self) -> list[OperationRecord]:
        return [op for op in self.training_ops.values() if not op.done.is_set()]

    def arrived(self, seq: int) -> bool:
        """Whether an op (accepted or refused) came with sequence number ``seq``."""
        return seq in self.by_seq or seq in self.refused

    def is_blocked(self) -> bool:
        """Ops wait for a sequence number that has not arrived."""
        nxt = self.sequencer.next_seq
        return not self.arrived(nxt) and any(s > nxt for s, op in self.by_seq.items() if not op.done.is_set())


@dataclass
class ModelPackageGroupRecord:
    name: str
    arn: str
    description: str | None
    created: float = field(default_factory=time.time)
    next_version: int = 1
    tags: list[dict[str, str]] = field(default_factory=list)


@dataclass
class ModelPackageRecord:
    arn: str
    group: str
    version: int
    description: str | None
    is_checkpoint: bool
    merged: bool
    inner_path: str
    model: HubModel
    rank: int  # the LoRA rank of the session that saved it
    session_name: str
    s3_uri: str
    created: float = field(default_factory=time.time)
