"""Datum builders shared by the client tests."""

from __future__ import annotations

import random
import threading

import anyio

from asyncsess import Datum, ModelInput, TensorData


def sft_datum(tokens: list[int]) -> Datum:
    """Train on every next token of ``tokens``."""
    n = len(tokens) - 1
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * n},
    )


def rl_datum(tokens: list[int], logprobs: list[float], advantage: float, prompt_len: int = 1) -> Datum:
    n = len(tokens) - 1
    adv = [0.0 if i < prompt_len - 1 else advantage for i in range(n)]
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData.from_list(tokens[1:], "int64"),
            "logprobs": [0.0 if i < prompt_len - 1 else lp for i, lp in enumerate(logprobs[:n])] + [0.0] * max(0, n - len(logprobs)),
            "advantages": adv,
        },
    )


def random_tokens(rng: random.Random, n: int, lo: int = 5, hi: int = 90) -> list[int]:
    return [rng.randrange(lo, hi) for _ in range(n)]


def count_concurrency(backend, monkeypatch, method: str = "sample", hold: threading.Event | None = None) -> dict[str, int]:
    """Wrap ``backend.<method>`` to record how many calls were in flight at once (``peak``).

    With ``hold``, each call waits inside the wrapper until ``hold`` is set, so a test can see every call in
    flight at once without racing the backend's latency.
    """
    state = {"now": 0, "peak": 0}
    real = getattr(backend, method)

    async def counting(*args, **kwargs):
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        try:
            while hold is not None and not hold.is_set():
                await anyio.sleep(0.002)
            return await real(*args, **kwargs)
        finally:
            state["now"] -= 1

    monkeypatch.setattr(backend, method, counting)
    return state


async def until(predicate, polls: int = 5000) -> bool:
    """Poll ``predicate`` every 2 ms (liveness only: the caller asserts on the result)."""
    for _ in range(polls):
        if predicate():
            return True
        await anyio.sleep(0.002)
    return predicate()
