"""forward_backward_custom: a custom loss equal to a built-in one gives the same gradients."""

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
