"""One training session's numbers: base table, trainable delta, gradient buffer and AdamW state.

``MockTrainer`` is synchronous and knows nothing about sessions, ordering or faults, so benchmarks can
call it directly as the zero-overhead baseline for the client.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from asyncsess.types import AdamParams, Datum, ForwardBackwardOutput, OptimStepResponse, TensorData, Usage

from .batch import pack_batch
from .losses import LOSSES, parse_config
from .model import base_table, grad_from_coeffs, log_softmax_table, token_logprobs
from .optim import AdamState, adamw_step

__all__ = ["MockTrainer"]


class MockTrainer:
    """Bigram model ``W + D`` with gradients that accumulate across ``forward_backward`` until ``optim_step``."""

    def __init__(self, base_model: str, vocab_size: int, max_context: int = 512) -> None:
        self.base_model = base_model
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.base = base_table(base_model, vocab_size)
        self.delta = np.zeros((vocab_size, vocab_size))
        self.grad = np.zeros((vocab_size, vocab_size))
        self.adam = AdamState.zeros((vocab_size, vocab_size))
        self._logp: np.ndarray | None = None
        self._probs: np.ndarray | None = None

    def logp_table(self) -> np.ndarray:
        """Cached log-softmax of ``W + D``; rebuilt after the weights change."""
        if self._logp is None:
            self._logp = log_softmax_table(self.base + self.delta)
        return self._logp

    def _probs_table(self) -> np.ndarray:
        if self._probs is None:
            self._probs = np.exp(self.logp_table())
        return self._probs

    def _weights_changed(self) -> None:
        self._logp = self._probs = None

    def forward(self, data: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, float] | None = None) -> ForwardBackwardOutput:
        return self._run(data, loss_fn, loss_fn_config, backward=False)

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, float] | None = None
    ) -> ForwardBackwardOutput:
        return self._run(data, loss_fn, loss_fn_config, backward=True)

    def _run(self, data: Sequence[Datum], loss_fn: str, config: Mapping[str, float] | None, *, backward: bool) -> ForwardBackwardOutput:
        cfg = parse_config(loss_fn, config)  # an unknown loss or key fails before any work
        batch = pack_batch(data, loss_fn, self.vocab_size, self.max_context)
        p = token_logprobs(self.logp_table(), batch.inputs, batch.targets)
        loss, g = LOSSES[loss_fn](p, batch.tensors, cfg, batch.seg)
        if backward:
            self.grad += grad_from_coeffs(self._probs_table(), batch.inputs, batch.targets, g)
        p32 = p.astype(np.float32)
        outputs = [
            {"logprobs": TensorData.model_construct(data=p32[a:b].tolist(), dtype="float32", shape=shape)}
            for a, b, shape in zip(batch.offsets[:-1].tolist(), batch.offsets[1:].tolist(), batch.shapes)
        ]
        return ForwardBackwardOutput.model_construct(
            loss_fn_output_type="TensorData",
            loss_fn_outputs=outputs,
            metrics={"loss:sum": loss},
            usage=Usage.model_construct(training_tokens=batch.num_tokens, prefill_tokens=0, decode_tokens=0),
        )

    def optim_step(self, params: AdamParams | None = None) -> OptimStepResponse:
        """One AdamW step; a non-finite gradient is cleared without a step (``NonFiniteGradientError``)."""
        try:
            metrics = adamw_step(self.delta, self.grad, self.adam, params or AdamParams())
        finally:
            self.grad[:] = 0.0
        self._weights_changed()
        return OptimStepResponse.model_construct(metrics=metrics, step=self.adam.step)

    def load(self, delta: np.ndarray, adam: AdamState | None) -> None:
        """Replace the weights; ``adam=None`` starts a fresh optimizer. Pending gradients are dropped."""
        self.delta = delta.copy()
        self.adam = adam.copy() if adam is not None else AdamState.zeros(self.delta.shape)
        self.grad[:] = 0.0
        self._weights_changed()
