"""GPU readiness of the local engine, checked on CPU: running out of memory is survived (the pass is
retried at a smaller token budget, gradients put back, a typed error when a datum alone does not fit),
decoder layers can be checkpointed without changing the gradient, one host copy per micro-batch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from asyncsess.backends import TrainingSessionSpec  # noqa: E402
from asyncsess.errors import InvalidInputError, ResourceExhaustedError, ServerError  # noqa: E402
from asyncsess.types import AdamParams  # noqa: E402

from .helpers import TOL, Ops, sft_datum  # noqa: E402

pytestmark = [pytest.mark.local, pytest.mark.anyio]

TEXT = "what is 2 plus 3? the answer is 5."
LONG = "the small cat and the large dog learn one two three four five six seven eight nine ten answer is good"


@pytest.fixture
def oom_above(monkeypatch):
    """Make every packed pass over more than ``limit`` tokens raise ``torch.OutOfMemoryError`` (as CUDA would)."""
    from asyncsess_local import trainer

    real = trainer.packed_logprobs
    seen: list[int] = []

    def install(limit: int) -> list[int]:
        def packed(model, seqs, **kw):
            n = sum(len(s) for s, _ in seqs)
            seen.append(n)
            if n > limit:
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n} MiB (injected)")
            return real(model, seqs, **kw)

        monkeypatch.setattr(trainer, "packed_logprobs", packed)
        return seen

    return install


async def _session(b, tiny):
    await b.open()
    return (await b.create_training_session(TrainingSessionSpec(base_model=tiny, rank=4, seed=0))).model_id


def _weights(b, model_id):
    eng = b.engine
    sess = eng.sessions[model_id]
    return {k: v.detach().cpu().clone() for k, v in eng.slots[sess.base_model].host.state_dict(sess.adapter).items()}


def _grads(b, model_id):
    """The session's accumulated gradient as one vector (before optim_step)."""
    params = b.engine.sessions[model_id].params
    return torch.cat([params[k].grad.detach().float().cpu().flatten() for k in sorted(params)])


def _close(a, b):
    return float((a - b).norm()) <= 10 * TOL * float(b.norm())  # a pass applied twice is off by ~100%


async def _train(b, model_id, ops, batches, grads=None):
    """forward_backward each batch (``grads`` gets the accumulated gradient), then one optim_step; returns the fb outputs."""
    outs = [await b.execute_training(model_id, ops("forward_backward", data=tuple(d), loss_fn="cross_entropy")) for d in batches]
    if grads is not None:
        grads.append(_grads(b, model_id))
    await b.execute_training(model_id, ops("optim_step", adam_params=AdamParams(learning_rate=1e-2)))
    return outs


async def test_oom_halves_the_budget_and_the_pass_still_matches(backend_factory, tiny, oom_above):
    # lengths 14, 14, 22, 8 and room for 29 tokens: at budget 32 the first micro-batch (28) runs and
    # accumulates, then [22, 8] runs out; at 16 every datum fits alone
    data = [sft_datum([5 + (i * 7 + j) % 300 for j in range(n + 1)]) for i, n in enumerate((14, 14, 22, 8))]
    room = 29
    ref, b = backend_factory(), backend_factory()
    try:
        ref_id = await _session(ref, tiny)
        grads = []
        (want,) = await _train(ref, ref_id, Ops(), [data], grads)

        seen = oom_above(room)
        model_id = await _session(b, tiny)
        (got,) = await _train(b, model_id, Ops(), [data], grads)
        assert b.engine.stats["oom"] == 9 and 28 in seen  # 8192 ... 32 ran out (32 after one micro-batch) ...
        assert b.engine.token_budget == 16  # ... and the budget stays lowered
        assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=TOL)
        for g, w in zip(got.loss_fn_outputs, want.loss_fn_outputs):
            assert g["logprobs"].data == pytest.approx(w["logprobs"].data, abs=TOL)
        assert _close(grads[1], grads[0])  # no half pass was applied twice
    finally:
        await ref.aclose()
        await b.aclose()


async def test_a_datum_that_cannot_fit_fails_typed_and_the_session_lives_on(backend_factory, tiny, oom_above):
    tok = backend_factory().get_tokenizer(tiny)
    small, big = sft_datum(tok.encode(TEXT)), sft_datum(tok.encode(LONG + " " + LONG))
    assert big.model_input.length > small.model_input.length

    ref, b = backend_factory(), backend_factory(token_budget=4096)
    try:
        ref_id = await _session(ref, tiny)
        grads = []
        await _train(ref, ref_id, Ops(), [[small], [small]], grads)

        oom_above(small.model_input.length)  # the small datum fits alone, the big one never does
        model_id = await _session(b, tiny)
        ops = Ops()
        await b.execute_training(model_id, ops("forward_backward", data=(small,), loss_fn="cross_entropy"))
        with pytest.raises(ResourceExhaustedError) as info:  # the small datum's micro-batch ran, then the big one failed
            await b.execute_training(model_id, ops("forward_backward", data=(small, big), loss_fn="cross_entropy"))
        err = info.value
        assert isinstance(err, ServerError) and err.budget is not None and err.budget < 4096
        assert f"token budget {err.budget}" in str(err) and "out of device memory" in str(err)
        assert err.seq == 2 and err.operation == "forward_backward"

        # still alive: the next ops run (no PoisonedError), and the failed op left no gradient behind
        await b.execute_training(model_id, ops("forward_backward", data=(small,), loss_fn="cross_entropy"))
        assert _close(_grads(b, model_id), grads[0])  # 2 x small, not 3 x: the failed op's first micro-batch was undone
        step = await b.execute_training(model_id, ops("optim_step", adam_params=AdamParams(learning_rate=1e-2)))
        assert step.step == 1
        mine, theirs = _weights(b, model_id), _weights(ref, ref_id)
        assert all(torch.allclose(mine[k], theirs[k], atol=TOL / 10) for k in theirs)
    finally:
        await ref.aclose()
        await b.aclose()


async def test_oom_while_sampling_is_typed_and_does_not_stick(backend_factory, tiny, monkeypatch):
    from asyncsess.backends import SampleRequest, SamplerSpec
    from asyncsess.types import SamplingParams

    b = backend_factory()
    try:
        await b.open()
        sid = await b.create_sampler(SamplerSpec(base_model=tiny))
        slot = b.engine.slots[tiny]
        real = slot.sampler.run
        monkeypatch.setattr(slot.sampler, "run", lambda jobs: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory")))
        req = SampleRequest(prompt=[1, 2, 3], num_samples=1, sampling_params=SamplingParams(max_tokens=2, temperature=0.0))
        with pytest.raises(ResourceExhaustedError):
            await b.sample(sid, req)
        monkeypatch.setattr(slot.sampler, "run", real)
        out = await b.sample(sid, req)
        assert len(out.sequences[0].tokens) == 2
    finally:
        await b.aclose()


async def test_checkpointed_layers_recompute_and_give_the_same_gradient(backend_factory, tiny):
    tok = backend_factory().get_tokenizer(tiny)
    data = [sft_datum(tok.encode(TEXT)), sft_datum(tok.encode(LONG))]
    plain, ckpt = backend_factory(checkpoint_layers="off"), backend_factory(checkpoint_layers="on")
    try:
        ids = [await _session(x, tiny) for x in (plain, ckpt)]
        assert plain.engine.slots[tiny].checkpointed_layers == 0
        assert ckpt.engine.slots[tiny].checkpointed_layers == 2  # the tiny Llama's two decoder layers
        calls = {"plain": 0, "ckpt": 0}
        for name, x in (("plain", plain), ("ckpt", ckpt)):
            mlp = x.engine.slots[tiny].host.peft.get_base_model().model.layers[0].mlp
            mlp.register_forward_pre_hook(lambda *a, n=name: calls.__setitem__(n, calls[n] + 1))
        seqs, grads = [Ops(), Ops()], []
        outs = [await _train(x, i, o, [data], grads) for x, i, o in zip((plain, ckpt), ids, seqs)]
        assert calls == {"plain": 1, "ckpt": 2}  # backward ran layer 0 again instead of keeping its activations
        assert outs[1][0].metrics["loss:sum"] == pytest.approx(outs[0][0].metrics["loss:sum"], rel=TOL)
        assert _close(grads[1], grads[0])
        # inference passes are not recomputed (no autograd)
        await ckpt.execute_training(ids[1], seqs[1]("forward", data=tuple(data), loss_fn="cross_entropy"))
        assert calls["ckpt"] == 3
    finally:
        await plain.aclose()
        await ckpt.aclose()


async def test_bad_memory_options_are_refused(backend_factory):
    with pytest.raises(InvalidInputError) as info:
        backend_factory(token_budget=0)
    assert info.value.field == "token_budget"
    b = backend_factory(checkpoint_layers="sometimes")
    with pytest.raises(InvalidInputError) as info:
        b.engine  # noqa: B018 - the engine is built on first use
    assert info.value.field == "checkpoint_layers"


async def test_oom_over_http_arrives_typed_and_the_worker_session_lives_on(backend_factory, tiny, oom_above):
    pytest.importorskip("fastapi")
    from asyncsess.backends.http import HttpBackend
    from asyncsess_local.server import serve_in_thread

    worker = serve_in_thread(backend_factory(), ["k"])
    client = HttpBackend(worker.url, api_key="k")
    try:
        tok = client.get_tokenizer(tiny)
        small, big = sft_datum(tok.encode(TEXT)), sft_datum(tok.encode(LONG + " " + LONG))
        oom_above(small.model_input.length)
        model_id = (await client.create_training_session(TrainingSessionSpec(base_model=tiny, rank=4, seed=0))).model_id
        ops = Ops()
        with pytest.raises(ResourceExhaustedError) as info:
            await client.execute_training(model_id, ops("forward_backward", data=(big,), loss_fn="cross_entropy"))
        assert "token budget" in str(info.value) and info.value.seq == 1
        out = await client.execute_training(model_id, ops("forward_backward", data=(small,), loss_fn="cross_entropy"))
        assert len(out.loss_fn_outputs[0]["logprobs"].data) == small.model_input.length
    finally:
        await client.aclose()
        worker.stop()


def test_free_memory_empties_the_cuda_cache(monkeypatch):
    from asyncsess_local import trainer

    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    trainer.free_memory(torch.device("cpu"))
    assert calls == []
    trainer.free_memory(torch.device("cuda"))
    assert calls == ["empty"]


def test_fused_adamw_steps_like_the_loop_and_reloads():
    """The engine's CUDA optimizer (fused) against the CPU one, and its state through save/load."""
    from asyncsess_local import trainer

    torch.manual_seed(0)
    start = {"m.lora_A.weight": torch.randn(4, 8), "m.lora_B.weight": torch.randn(8, 4)}
    grads = [{k: torch.randn_like(v) for k, v in start.items()} for _ in range(3)]
    adam = AdamParams(learning_rate=1e-2, weight_decay=0.1)

    def run(fused: bool, steps: range, sess=None):
        if sess is None:
            params = {k: torch.nn.Parameter(v.clone()) for k, v in start.items()}
            sess = trainer.TrainSession("m", "b", "a", 4, 8.0, [], 0, params, trainer.new_optimizer(params, fused=fused))
        for i in steps:
            for k, p in sess.params.items():
                p.grad = grads[i][k].clone()
            trainer.optim_step(sess, adam)
        return sess

    loop, fused = run(False, range(3)), run(True, range(3))
    assert fused.optimizer.defaults["fused"] and not loop.optimizer.defaults.get("fused")
    assert all(torch.allclose(fused.params[k], loop.params[k], atol=1e-6) for k in start)

    half = run(True, range(2))
    params = {k: torch.nn.Parameter(p.detach().clone()) for k, p in half.params.items()}
    again = trainer.TrainSession("m", "b", "a", 4, 8.0, [], 0, params, trainer.new_optimizer(params, fused=True))
    trainer.load_optimizer_tensors(again, trainer.optimizer_tensors(half))
    run(True, range(2, 3), again)
    assert all(torch.equal(again.params[k], fused.params[k]) for k in start)  # resumed bit-exactly
