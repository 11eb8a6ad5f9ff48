"""What the local backend needs over the seam's typed op records: the pass kinds and the refusal of a kind
no ``match`` handles (typed ``Never``, so mypy flags a kind a ``match`` forgot)."""

from __future__ import annotations

from typing import NoReturn

from typing_extensions import Never

from asyncsess.backends import ForwardBackwardOp, ForwardOp
from asyncsess.errors import InvalidInputError

__all__ = ["PassOp", "unknown_op"]

PassOp = ForwardOp | ForwardBackwardOp
"""An op that runs the model over datums (``forward``, ``forward_backward``); consecutive ones are packed."""


def unknown_op(op: Never) -> NoReturn:
    """The ``case _`` of an exhaustive ``match`` on a ``TrainingOp``: unreachable for well-typed callers."""
    raise InvalidInputError(
        f"unknown op {getattr(op, 'kind', type(op).__name__)!r}",
        field="kind",
        fix="use forward, forward_backward, optim_step, save_state, save_weights or load_state",
    )
