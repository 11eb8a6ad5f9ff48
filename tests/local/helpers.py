"""Helpers shared by the local backend tests."""

from __future__ import annotations

import os

import anyio

from asyncsess.backends import OP_TYPES, TrainingOp
from asyncsess.types import Datum, ModelInput


def sft_datum(tokens: list[int], weights: list[float] | None = None) -> Datum:
    """Next-token SFT datum on ``tokens``."""
    n = len(tokens) - 1
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights if weights is not None else [1.0] * n},
    )


class Ops:
    """Builds ``TrainingOp``s with consecutive sequence numbers for one session."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **kw) -> TrainingOp:
        self.seq += 1
        return OP_TYPES[kind](seq=self.seq, idempotency_key=f"key-{self.seq}", **kw)


# The device and dtype the local suite runs on: ASYNCSESS_TEST_DEVICE (default cpu; e.g. cuda, cuda:1) and
# ASYNCSESS_TEST_DTYPE (default float32; bfloat16 on a GPU), so the same suite runs on a GPU unchanged.
TEST_DEVICE = os.environ.get("ASYNCSESS_TEST_DEVICE") or "cpu"
TEST_DTYPE = os.environ.get("ASYNCSESS_TEST_DTYPE") or "float32"
DEVICE_KW = {"device": TEST_DEVICE, "dtype": TEST_DTYPE}  # LocalBackend(**DEVICE_KW, ...)
DEVICE_QUERY = f"device={TEST_DEVICE}&dtype={TEST_DTYPE}"  # local://?...&{DEVICE_QUERY}
# absolute tolerance for comparing log-probs or weights of two runs that round differently (another packing)
TOL = 1e-5 if TEST_DTYPE in ("float32", "fp32") else 5e-2


async def base_and_tuned_samplers(b, tiny: str, steps: int):
    """On an open backend: its tokenizer, a base sampler, and a sampler on an adapter trained ``steps`` SFT steps."""
    from asyncsess.backends import SamplerSpec, TrainingSessionSpec
    from asyncsess.types import AdamParams

    tok = b.get_tokenizer(tiny)
    a = await b.create_training_session(TrainingSessionSpec(base_model=tiny, rank=4, seed=0))
    ops = Ops()
    for _ in range(steps):
        await b.execute_training(
            a.model_id, ops("forward_backward", data=(sft_datum(tok.encode("the cat and the dog")),), loss_fn="cross_entropy")
        )
        await b.execute_training(a.model_id, ops("optim_step", adam_params=AdamParams(learning_rate=5e-2)))
    saved = await b.execute_training(a.model_id, ops("save_weights", ephemeral=True))
    base = await b.create_sampler(SamplerSpec(base_model=tiny))
    tuned = await b.create_sampler(SamplerSpec(model_path=saved.path))
    return tok, base, tuned


async def hold_engine(engine):
    """Block the engine thread on a gate (returns the gate and the call's completion) once it has taken the
    call, so that what the test sends next waits in the engine's queue."""
    import threading

    gate = threading.Event()
    busy = engine.call_soon(gate.wait)
    for _ in range(10_000):  # liveness only
        if not engine._queue:
            break
        await anyio.sleep(0.002)
    assert not engine._queue, "the engine thread never took the gate"
    return gate, busy


async def until_queued(engine, n: int) -> None:
    """Wait until ``n`` sample requests sit in the engine's queue (behind :func:`hold_engine`'s gate)."""
    from asyncsess_local.engine import SampleWork

    for _ in range(10_000):  # liveness only: the assertion below is what counts
        if sum(isinstance(w, SampleWork) for w in list(engine._queue)) >= n:
            break
        await anyio.sleep(0.002)
    assert sum(isinstance(w, SampleWork) for w in list(engine._queue)) == n
