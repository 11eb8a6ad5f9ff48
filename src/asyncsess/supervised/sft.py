"""Supervised fine-tuning helpers: chat datums trained on assistant tokens, learning-rate schedules,
submit-ahead pipelining, and the held-out NLL evaluator."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ..chat import Message, assistant_spans
from ..client import TrainingClient
from ..errors import InvalidInputError
from ..futures import APIFuture
from ..runs.schedule import LRSchedule, decayed_lr
from ..types import Datum, ForwardBackwardOutput, ModelInput, OptimStepResponse, TensorData

__all__ = ["TrainOn", "conversation_datum", "learning_rate", "SubmitAhead", "mean_nll", "nll"]

TrainOn = Literal["all_assistant_messages", "last_assistant_message"]


def conversation_datum(
    tokenizer: Any, messages: Sequence[Message], train_on: TrainOn = "all_assistant_messages", max_length: int | None = None
) -> Datum:
    """A ``cross_entropy`` datum of the rendered conversation with weight 1 on the assistant tokens
    (content and end-of-turn, not the role header) and 0 elsewhere; truncated to ``max_length`` tokens.
    A ``train_on`` that is not one of the two choices, a ``max_length`` under 2 and ``messages`` that are not a
    list of message dicts are InvalidInputErrors naming the argument."""
    if train_on not in ("all_assistant_messages", "last_assistant_message"):
        raise InvalidInputError(
            f"{train_on!r:.60} is not a choice", field="train_on", fix="pass 'all_assistant_messages' or 'last_assistant_message'"
        )
    if max_length is not None and (type(max_length) is not int or max_length < 2):
        raise InvalidInputError(
            f"max_length={max_length!r:.40}", field="max_length", fix="an int >= 2 (one input and one target token), or None"
        )
    if isinstance(messages, (str, bytes)) or not all(isinstance(m, Mapping) for m in messages):
        raise InvalidInputError(
            f"{messages!r:.60} is not a list of messages", field="messages", fix='pass [{"role": "user", "content": "..."}, ...]'
        )
    tokens, spans = assistant_spans(tokenizer, messages)
    if not spans:
        raise InvalidInputError("no assistant message to train on", field="messages", fix="add a message with role 'assistant'")
    if train_on == "last_assistant_message":
        spans = spans[-1:]
    weights = [0.0] * len(tokens)
    for start, end in spans:
        weights[start:end] = [1.0] * (end - start)
    if max_length is not None:
        tokens, weights = tokens[:max_length], weights[:max_length]
    n = len(tokens) - 1
    return Datum.model_construct(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData.model_construct(data=tokens[1:], dtype="int64", shape=[n]),
            "weights": TensorData.model_construct(data=weights[1:], dtype="float32", shape=[n]),
        },
    )


def learning_rate(base: float, step: int, total: int, schedule: LRSchedule = "linear") -> float:
    """``base`` decayed to 0 over ``total`` steps (cookbook SFT schedules)."""
    return decayed_lr(base, step / max(1, total), schedule)


class SubmitAhead:
    """Keeps up to ``1 + submit_ahead`` training steps in flight.

    ``push`` queues a step's ``forward_backward`` and ``optim_step`` futures and returns the steps that
    must now be awaited (the oldest, once more than ``submit_ahead`` are pending), so step k+1 is on the
    server before step k's results are read. ``drain`` returns the rest.
    """

    def __init__(self, submit_ahead: int = 1) -> None:
        if submit_ahead < 0:
            raise ValueError("submit_ahead must be >= 0")
        self.submit_ahead = submit_ahead
        self._pending: deque[tuple[int, APIFuture[ForwardBackwardOutput], APIFuture[OptimStepResponse]]] = deque()

    async def push(
        self, step: int, fb: APIFuture[ForwardBackwardOutput], opt: APIFuture[OptimStepResponse]
    ) -> list[tuple[int, ForwardBackwardOutput, OptimStepResponse]]:
        self._pending.append((step, fb, opt))
        done = []
        while len(self._pending) > self.submit_ahead:
            s, f, o = self._pending.popleft()
            done.append((s, await f, await o))
        return done

    async def drain(self) -> list[tuple[int, ForwardBackwardOutput, OptimStepResponse]]:
        done = []
        while self._pending:
            s, f, o = self._pending.popleft()
            done.append((s, await f, await o))
        return done


def mean_nll(out: ForwardBackwardOutput, data: Sequence[Datum]) -> float:
    """``loss:sum`` of a ``cross_entropy`` pass divided by the total weight of ``data``."""
    total = sum(sum(d.loss_fn_inputs["weights"].data) for d in data)
    return out.metrics["loss:sum"] / total if total else float("nan")


async def nll(tc: TrainingClient, data: Sequence[Datum]) -> float:
    """Held-out mean negative log-likelihood per trained token (``test/nll``): a ``forward`` pass, no gradients."""
    return mean_nll(await tc.forward(list(data), "cross_entropy"), data)
