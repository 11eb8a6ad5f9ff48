"""forward_backward_custom: a custom loss equal to a built-in one gives the same gradients."""

import math

import numpy as np
import pytest
import torch

from asyncsess import AdamParams, Datum, ServiceClient
from asyncsess.rl.data import rl_datum

pytestmark = [pytest.mark.anyio, pytest.mark.torch]

ADAM = AdamParams(learning_rate=0.1)


def _batch() -> list[Datum]:
    return [
        rl_datum([1, 40, 41], [42, 43, 44], [-4.2, -4.5, -4.4], 1.0),
        rl_datum([1, 50], [51, 52], [-4.6, -4.1], -0.5),
    ]


def importance_sampling(data: list[Datum], logprobs: list) -> tuple:
    loss = 0
    for d, p in zip(data, logprobs):
        q = torch.tensor(d.loss_fn_inputs["logprobs"].data)
        a = torch.tensor(d.loss_fn_inputs["advantages"].data)
        loss = loss - (torch.exp(p - q) * a).sum()
    return loss, {"custom:mean": 1.0}


async def test_custom_loss_matches_builtin_gradients():
    async with ServiceClient("mock://") as svc:
        builtin = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        custom = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        out_b = await builtin.forward_backward(_batch(), "importance_sampling")
        await builtin.optim_step(ADAM)
        fut = custom.forward_backward_custom(_batch(), importance_sampling)
        assert fut.seq == 1 and custom.current_sequence_number == 2, "both passes are numbered at call time"
        out_c = await fut
        await custom.optim_step(ADAM)
        assert out_c.metrics["loss:sum"] == pytest.approx(out_b.metrics["loss:sum"], rel=1e-5)
        assert out_c.metrics["custom:mean"] == 1.0 and "surrogate_loss:sum" in out_c.metrics
        w_b, w_c = svc.backend.weights(builtin.model_id), svc.backend.weights(custom.model_id)
        assert np.abs(w_b).max() > 0
        np.testing.assert_allclose(w_c, w_b, atol=1e-5)


async def test_custom_loss_lowering_sends_minus_dl_dp_as_weights(monkeypatch):
    """The IS worked example: weights [1.221403, 0.452419, -3.644238] (derived by hand; the math: docs/losses.md)."""
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        sent = []
        real = svc.backend.execute_training

        async def spy(session_id, op):
            sent.append(op)
            return await real(session_id, op)

        monkeypatch.setattr(svc.backend, "execute_training", spy)
        q = torch.tensor([-0.7, -1.1, -2.6])
        a = torch.tensor([1.0, 0.5, -2.0])
        p_fixed = torch.tensor([-0.5, -1.2, -2.0])

        def shifted_is(data, logprobs):
            p = logprobs[0]
            p_eff = p - p.detach() + p_fixed  # value of the worked example, gradient of the real p
            return -(torch.exp(p_eff - q) * a).sum(), {}

        d = Datum(model_input=[1, 40, 41], loss_fn_inputs={"target_tokens": [40, 41, 42], "weights": [1.0, 1.0, 1.0]})
        out = await tc.forward_backward_custom([d], shifted_is)
        assert [op.kind for op in sent] == ["forward", "forward_backward"]
        np.testing.assert_allclose(sent[1].data[0].loss_fn_inputs["weights"].data, [1.221403, 0.452419, -3.644238], atol=1e-5)
        assert out.metrics["loss:sum"] == pytest.approx(1.970416, abs=1e-5)


async def test_a_backend_refusal_of_the_forward_pass_is_refused_before_numbering(monkeypatch):
    """A rule only the backend knows (its precheck) refuses forward_backward_custom's passes at call time, as it does
    forward_backward's: no number taken, nothing poisoned (the forward used to be numbered unchecked)."""
    from asyncsess import InvalidInputError
    from asyncsess.backends.base import ForwardOp

    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        seen = []

        def precheck(session_id, op):
            seen.append(op.kind)
            if isinstance(op, ForwardOp):
                raise InvalidInputError("this backend refuses it", field="data[0].model_input", fix="shorten it")

        monkeypatch.setattr(svc.backend, "precheck", precheck)
        with pytest.raises(InvalidInputError) as err:
            tc.forward_backward_custom(_batch(), importance_sampling)
        assert err.value.field == "data[0].model_input" and seen == ["forward"]
        assert tc.current_sequence_number == 0
        monkeypatch.undo()
        out = await tc.forward_backward_custom(_batch(), importance_sampling)
        assert out.metrics["custom:mean"] == 1.0 and tc.current_sequence_number == 2


def _raises(data, logprobs):
    raise KeyError("advantage")


BAD_LOSSES = {
    "raises": _raises,
    "nan-loss": lambda data, lp: (lp[0].sum() * float("nan"), {}),
    "inf-loss": lambda data, lp: (lp[0].sum() * float("inf"), {}),
    "inf-gradient": lambda data, lp: (torch.sqrt(lp[0] - lp[0].detach()).sum(), {}),  # value 0, slope 1/(2·√0)
    "huge-gradient": lambda data, lp: ((lp[0] - lp[0].detach()).sum() * 1e9, {}),
    "per-token-loss": lambda data, lp: (-lp[0], {}),
    "float-loss": lambda data, lp: (lp[0].sum().item(), {}),
    "detached-loss": lambda data, lp: (lp[0].sum().detach(), {}),
    "no-tuple": lambda data, lp: lp[0].sum(),
    "metric-not-a-number": lambda data, lp: (lp[0].sum(), {"note": "hello"}),
    "metrics-not-a-dict": lambda data, lp: (lp[0].sum(), [1.0]),
    "in-place-on-logprobs": lambda data, lp: (lp[0].mul_(2).sum(), {}),
}


@pytest.mark.parametrize("loss_fn", BAD_LOSSES.values(), ids=BAD_LOSSES.keys())
async def test_a_broken_loss_fn_fails_its_future_typed_and_applies_nothing(loss_fn):
    """A loss fn that raises or returns no finite scalar with finite gradients used to poison the client for good (or
    to send NaN weights). Now its future fails with InvalidInputError naming loss_fn, the reserved backward number
    runs a forward (nothing applied), and the ops after it run."""
    from asyncsess import InvalidInputError

    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        await tc.forward_backward(_batch(), "importance_sampling")
        await tc.optim_step(ADAM)
        before = svc.backend.weights(tc.model_id).copy()
        bad = tc.forward_backward_custom(_batch(), loss_fn)
        nxt = tc.forward_backward(_batch(), "importance_sampling")  # queued behind both reserved numbers
        with pytest.raises(InvalidInputError) as err:
            await bad
        assert err.value.field == "loss_fn" and err.value.fix
        out = await nxt
        assert (bad.seq, nxt.seq) == (3, 5) and math.isfinite(out.metrics["loss:sum"])
        np.testing.assert_array_equal(svc.backend.weights(tc.model_id), before)
        step = await tc.optim_step(ADAM)  # applies nxt's gradient alone
        assert step is not None and not np.array_equal(svc.backend.weights(tc.model_id), before)


async def test_a_loss_fn_that_mutates_its_inputs_does_not_change_what_is_trained(monkeypatch):
    """The loss fn gets copies: overwriting a target token there (here with one outside the vocabulary) used to
    reach the backward pass, which trained a target the forward never scored (or was refused after numbering)."""
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        sent = []
        real = svc.backend.execute_training

        async def spy(session_id, op):
            sent.append(op)
            return await real(session_id, op)

        monkeypatch.setattr(svc.backend, "execute_training", spy)
        batch = _batch()
        targets = list(batch[0].loss_fn_inputs["target_tokens"].data)

        def vandal(data, logprobs):
            data[0].loss_fn_inputs["target_tokens"].data[0] = 10**6
            data[0].loss_fn_inputs.clear()
            return importance_sampling(_batch(), logprobs)

        await tc.forward_backward_custom(batch, vandal)
        assert sent[1].data[0].loss_fn_inputs["target_tokens"].data == targets
        assert batch[0].loss_fn_inputs["target_tokens"].data == targets


async def test_a_custom_loss_over_the_chunk_limit_trains_like_one_op():
    """forward_backward_custom sent a batch of any size as one op; now each pass is chunked like forward_backward's."""
    async with ServiceClient("mock://") as one, ServiceClient("mock://", max_chunk_datums=1) as split:
        a = await one.create_lora_training_client("mock/bigram-tiny", rank=4)
        b = await split.create_lora_training_client("mock/bigram-tiny", rank=4)
        out_a = await a.forward_backward_custom(_batch(), importance_sampling)
        fut = b.forward_backward_custom(_batch(), importance_sampling)
        assert b.current_sequence_number == 4, "two chunks: two forwards, then two backwards"
        out_b = await fut
        await a.optim_step(ADAM)
        await b.optim_step(ADAM)
        assert out_b.metrics["loss:sum"] == pytest.approx(out_a.metrics["loss:sum"], rel=1e-6)
        assert len(out_b.loss_fn_outputs) == 2
        np.testing.assert_allclose(one.backend.weights(a.model_id), split.backend.weights(b.model_id), atol=1e-6)


def _refuse_at_its_turn(monkeypatch, backend, kind, seqs):
    """mock:// judges each op again at its turn (its precheck, in the executor): refuse ops of ``kind`` whose seq is in
    ``seqs`` there, as a remote backend refuses an op void after the client numbered it."""
    from asyncsess import InvalidInputError

    real = backend.precheck

    def precheck(session_id, op):
        if isinstance(op, kind) and op.seq in seqs:
            raise InvalidInputError("refused at its turn", field="data", fix="-")
        return real(session_id, op)

    monkeypatch.setattr(backend, "precheck", precheck)


async def test_a_forward_refused_at_its_turn_fills_the_backward_and_poisons_nothing(monkeypatch):
    """The forward pass refused void after numbering used to poison the client for good (its backward number was
    never filled); now the backward's number runs a forward, the call fails void, and the ops after it run."""
    from asyncsess import InvalidInputError
    from asyncsess.backends.base import ForwardOp

    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        calls = []

        def loss(data, logprobs):
            calls.append(1)
            return importance_sampling(data, logprobs)

        custom = tc.forward_backward_custom(_batch(), loss)
        nxt = tc.forward_backward(_batch(), "importance_sampling")
        _refuse_at_its_turn(monkeypatch, svc.backend, ForwardOp, {custom.seq})  # before any of them ran: nothing awaited yet
        with pytest.raises(InvalidInputError) as err:
            await custom
        assert err.value.void and calls == []
        assert nxt.seq == custom.seq + 2 and math.isfinite((await nxt).loss)
        assert np.abs(svc.backend.weights(tc.model_id)).max() == 0  # no optim_step yet, nothing else applied


@pytest.mark.parametrize("chunks", [1, 2])
async def test_a_backward_refused_at_its_turn_poisons_only_when_split(monkeypatch, chunks):
    """One backward op refused void applied nothing: the ops after it run. Split in two, the other part ran (or is
    never sent): the client is poisoned, as for a chunked forward_backward."""
    from asyncsess import InvalidInputError, PoisonedError
    from asyncsess.backends.base import ForwardBackwardOp

    async with ServiceClient("mock://", max_chunk_datums=2 // chunks) as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        custom = tc.forward_backward_custom(_batch(), importance_sampling)
        nxt = tc.forward(_batch(), "importance_sampling")
        _refuse_at_its_turn(monkeypatch, svc.backend, ForwardBackwardOp, {custom.seq + chunks})  # the first backward
        with pytest.raises(InvalidInputError):
            await custom
        if chunks == 1:
            assert len((await nxt).loss_fn_outputs) == 2
        else:
            with pytest.raises(PoisonedError):
                await nxt
