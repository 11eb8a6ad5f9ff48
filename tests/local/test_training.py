"""The engine's training path on the tiny model: SFT converges, gradients match a hand-written reference,
merged passes equal sequential ones, sessions are isolated, bad input is refused, failures poison."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from asyncsess.backends import TrainingSessionSpec  # noqa: E402
from asyncsess.errors import InvalidInputError, SessionGoneError  # noqa: E402
from asyncsess.types import AdamParams, Datum, ModelInput  # noqa: E402

from .helpers import Ops, sft_datum  # noqa: E402

pytestmark = [pytest.mark.local, pytest.mark.anyio]

TEXT = "what is 2 plus 3? the answer is 5."


async def _session(b, tiny, **kw):
    return await b.create_training_session(TrainingSessionSpec(base_model=tiny, rank=kw.pop("rank", 8), seed=kw.pop("seed", 0), **kw))


async def test_sft_steps_reduce_the_loss(backend_factory, tiny):
    b = backend_factory()
    try:
        await b.open()
        info = await _session(b, tiny)
        tok = b.get_tokenizer(tiny)
        d = sft_datum(tok.encode(TEXT))
        ops = Ops()
        losses = []
        for _ in range(6):
            out = await b.execute_training(info.model_id, ops("forward_backward", data=(d,), loss_fn="cross_entropy"))
            step = await b.execute_training(info.model_id, ops("optim_step", adam_params=AdamParams(learning_rate=1e-2)))
            losses.append(out.metrics["loss:sum"])
        assert step.step == 6
        assert losses[-1] < 0.5 * losses[0]
        logprobs = out.loss_fn_outputs[0]["logprobs"]
        assert logprobs.dtype == "float32" and len(logprobs.data) == d.model_input.length
        assert -sum(logprobs.data) == pytest.approx(losses[-1], rel=1e-5)  # weights are all 1
        assert out.usage.training_tokens == d.model_input.length
    finally:
        await b.aclose()


def _rl_datum(tokens, seed):
    g = torch.Generator().manual_seed(seed)
    n = len(tokens) - 1
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": (-torch.rand(n, generator=g) * 6).tolist(),
            "advantages": (torch.randn(n, generator=g)).tolist(),
            "weights": (torch.rand(n, generator=g) > 0.2).float().tolist(),
            **({"sequence_ratio_mask": [0.0] * 2 + [1.0] * (n - 2)} if seed % 2 else {}),
        },
    )


LOSS_CASES = [
    ("cross_entropy", None),
    ("importance_sampling", None),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}),
    ("dro", {"beta": 0.05}),
    ("gspo", {"clip_low_threshold": 0.5, "clip_high_threshold": 3.0}),
]


@pytest.mark.parametrize(("loss_fn", "config"), LOSS_CASES, ids=[c[0] for c in LOSS_CASES])
async def test_gradients_match_a_hand_written_reference(backend_factory, tiny, loss_fn, config):
    """forward_backward's gradient equals plain autograd through the unpacked model with the loss written out."""
    b = backend_factory(token_budget=24)  # several micro-batches
    try:
        await b.open()
        info = await _session(b, tiny, seed=3)
        tok = b.get_tokenizer(tiny)
        data = [_rl_datum(tok.encode(t), i) for i, t in enumerate([TEXT, "hello world the cat", "one two three four five six seven"])]
        if loss_fn == "cross_entropy":
            data = [
                Datum(model_input=d.model_input, loss_fn_inputs={k: d.loss_fn_inputs[k] for k in ("target_tokens", "weights")})
                for d in data
            ]
        elif loss_fn != "gspo":
            data = [
                Datum(model_input=d.model_input, loss_fn_inputs={k: v for k, v in d.loss_fn_inputs.items() if k != "sequence_ratio_mask"})
                for d in data
            ]
        engine = b.engine
        sess = engine.sessions[info.model_id]
        with torch.no_grad():  # make B non-zero so every LoRA parameter gets a gradient
            for k, p in sess.params.items():
                if "lora_B" in k:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(k)))
        out = await b.execute_training(info.model_id, Ops()("forward_backward", data=tuple(data), loss_fn=loss_fn, loss_fn_config=config))
        got = {k: p.grad.clone() for k, p in sess.params.items()}

        # reference: one unpacked forward per datum through the full model, loss written out by hand
        for p in sess.params.values():
            p.grad = None
        model = engine.slots[tiny].host.peft
        engine.slots[tiny].host.activate(sess.adapter, trainable=True)
        total = 0.0
        cfg = config or {}
        lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
        for d in data:
            ids = torch.tensor([d.model_input.to_ints()])
            logits = model(input_ids=ids).logits[0].float()
            f = {k: torch.tensor(v.data) for k, v in d.loss_fn_inputs.items()}
            p = logits.log_softmax(-1).gather(-1, f["target_tokens"][:, None])[:, 0]
            w = f.get("weights")
            if loss_fn == "cross_entropy":
                loss = -(w * p).sum()
            else:
                q, adv = f["logprobs"], f["advantages"]
                r = torch.exp(p - q)
                if loss_fn == "importance_sampling":
                    per = r * adv
                elif loss_fn == "ppo":
                    per = torch.minimum(r * adv, r.clamp(lo, hi) * adv)
                elif loss_fn == "cispo":
                    per = r.clamp(lo, hi).detach() * p * adv
                elif loss_fn == "dro":
                    per = p * adv - 0.5 * cfg["beta"] * (p - q) ** 2
                else:
                    m = f.get("sequence_ratio_mask", torch.ones_like(p))
                    s = torch.exp(((p.detach() - q) * m).sum() / m.sum())
                    st = s * torch.exp(p - p.detach())
                    per = torch.minimum(st * adv, st.clamp(lo, hi) * adv)
                loss = -(per * w).sum()
            loss.backward()
            total += float(loss.detach())
        assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-4, abs=1e-4)
        for k, p in sess.params.items():
            torch.testing.assert_close(got[k], p.grad, rtol=1e-3, atol=1e-4 * float(p.grad.abs().max()), msg=lambda m, k=k: f"{k}: {m}")
    finally:
        await b.aclose()


async def test_queued_passes_merge_into_one_and_match_sequential(backend_factory, tiny):
    b = backend_factory()
    try:
        await b.open()
        tok = b.get_tokenizer(tiny)
        data = [sft_datum(tok.encode(t)) for t in (TEXT, "hello world", "the cat and the dog")]
        # sequential: one pass per datum, awaited one by one
        a = await _session(b, tiny, seed=1)
        ops_a = Ops()
        for d in data:
            await b.execute_training(a.model_id, ops_a("forward_backward", data=(d,), loss_fn="cross_entropy"))
        # queued at once: the engine merges them (they reach it before it wakes up)
        c = await _session(b, tiny, seed=1)
        ops_c = Ops()
        queued = [ops_c("forward_backward", data=(d,), loss_fn="cross_entropy") for d in data]
        engine = b.engine
        gate = threading.Event()
        busy = engine.call_soon(gate.wait)  # hold the engine so all three passes land in one batch
        passes = engine.stats["passes"]
        done = [engine.submit_training(c.model_id, op) for op in queued]
        gate.set()
        await busy.wait()
        outs = [await x.wait() for x in done]
        assert engine.stats["passes"] == passes + 1
        assert [len(o.loss_fn_outputs) for o in outs] == [1, 1, 1]
        ga = engine.sessions[a.model_id].params
        gc = engine.sessions[c.model_id].params
        for k in ga:
            torch.testing.assert_close(ga[k].grad, gc[k].grad, rtol=1e-4, atol=1e-5 * float(ga[k].grad.abs().max()))
    finally:
        await b.aclose()


async def test_two_sessions_do_not_affect_each_other(backend_factory, tiny):
    b = backend_factory()
    try:
        await b.open()
        tok = b.get_tokenizer(tiny)
        probe = sft_datum(tok.encode("hello world the answer is 7"))
        one = await _session(b, tiny, seed=0)
        two = await _session(b, tiny, seed=0, rank=4)
        o1, o2 = Ops(), Ops()
        before = await b.execute_training(two.model_id, o2("forward", data=(probe,), loss_fn="cross_entropy"))
        for _ in range(3):
            await b.execute_training(one.model_id, o1("forward_backward", data=(sft_datum(tok.encode(TEXT)),), loss_fn="cross_entropy"))
            await b.execute_training(one.model_id, o1("optim_step", adam_params=AdamParams(learning_rate=5e-2)))
        after = await b.execute_training(two.model_id, o2("forward", data=(probe,), loss_fn="cross_entropy"))
        moved = await b.execute_training(one.model_id, o1("forward", data=(probe,), loss_fn="cross_entropy"))
        assert after.loss_fn_outputs[0]["logprobs"].data == before.loss_fn_outputs[0]["logprobs"].data
        assert moved.loss_fn_outputs[0]["logprobs"].data != before.loss_fn_outputs[0]["logprobs"].data
        assert all(p.grad is None for p in b.engine.sessions[two.model_id].params.values())
    finally:
        await b.aclose()


async def test_adam_params_are_applied(backend_factory, tiny):
    b = backend_factory()
    try:
        await b.open()
        tok = b.get_tokenizer(tiny)
        d = sft_datum(tok.encode(TEXT))
        info = await _session(b, tiny)
        ops = Ops()
        sess = b.engine.sessions[info.model_id]
        await b.execute_training(info.model_id, ops("forward_backward", data=(d,), loss_fn="cross_entropy"))
        before = {k: p.detach().clone() for k, p in sess.params.items()}
        res = await b.execute_training(info.model_id, ops("optim_step", adam_params=AdamParams(learning_rate=0.0)))
        assert res.metrics["grad_norm"] > 0
        assert all(torch.equal(before[k], p) for k, p in sess.params.items())  # lr 0: nothing moves
        assert all(p.grad is None for p in sess.params.values())  # grads were zeroed
        # grad clipping bounds the reported (pre-clip) norm's effect: the first Adam step is ~lr per element anyway,
        # so check clipping directly on the gradients
        await b.execute_training(info.model_id, ops("forward_backward", data=(d,), loss_fn="cross_entropy"))
        norm = float(torch.nn.utils.get_total_norm([p.grad for p in sess.params.values()]))
        await b.execute_training(info.model_id, ops("optim_step", adam_params=AdamParams(learning_rate=0.0, grad_clip_norm=norm / 10)))
        assert sess.optimizer.param_groups[0]["lr"] == 0.0
        # decoupled weight decay: with a zero gradient (fresh moments) a step only scales the weights by 1 − lr·wd
        fresh = await _session(b, tiny, seed=5)
        fops = Ops()
        zero = sft_datum(tok.encode(TEXT), weights=[0.0] * (d.model_input.length))
        await b.execute_training(fresh.model_id, fops("forward_backward", data=(zero,), loss_fn="cross_entropy"))
        fsess = b.engine.sessions[fresh.model_id]
        a_key = next(k for k in fsess.params if "lora_A" in k)
        w0 = fsess.params[a_key].detach().clone()
        await b.execute_training(fresh.model_id, fops("optim_step", adam_params=AdamParams(learning_rate=0.1, weight_decay=0.5)))
        torch.testing.assert_close(fsess.params[a_key].detach(), w0 * (1 - 0.1 * 0.5))
        sess = fsess
        assert sess.optimizer.param_groups[0]["weight_decay"] == 0.5
    finally:
        await b.aclose()


async def test_the_smallest_adam_eps_allowed_keeps_the_weights_finite(backend_factory, tiny):
    """eps=1e-46 was accepted and is 0 in the float32 optimizer: every LoRA A (zero gradient while B is 0) got 0 / 0
    and the session's weights were NaN for good. The smallest eps now allowed steps a real and a zero gradient finitely."""
    from asyncsess.types import MIN_ADAM_EPS

    b = backend_factory()
    try:
        await b.open()
        d = sft_datum(b.get_tokenizer(tiny).encode(TEXT))
        info = await _session(b, tiny)
        ops = Ops()
        for _ in range(2):  # step 1: A's gradient is exactly 0 (B = 0); step 2: both move
            await b.execute_training(info.model_id, ops("forward_backward", data=(d,), loss_fn="cross_entropy"))
            await b.execute_training(info.model_id, ops("optim_step", adam_params=AdamParams(learning_rate=1e-3, eps=MIN_ADAM_EPS)))
        assert all(bool(p.isfinite().all()) for p in b.engine.sessions[info.model_id].params.values())
        out = await b.execute_training(info.model_id, ops("forward", data=(d,), loss_fn="cross_entropy"))
        assert out.metrics["loss:sum"] == out.metrics["loss:sum"]  # not NaN
    finally:
        await b.aclose()


async def test_bad_input_is_refused_void_and_the_next_op_runs(backend_factory, tiny):
    """Refused at its turn before anything ran: the seq is used up (void) and the session is not poisoned."""
    b = backend_factory()
    try:
        await b.open()
        tok = b.get_tokenizer(tiny)
        info = await _session(b, tiny)
        ops = Ops()
        bad_token = Datum(
            model_input=ModelInput.from_ints([1, 2, 99999]), loss_fn_inputs={"target_tokens": [1, 2, 3], "weights": [1.0] * 3}
        )
        with pytest.raises(InvalidInputError, match="vocabulary") as err:
            await b.execute_training(info.model_id, ops("forward_backward", data=(bad_token,), loss_fn="cross_entropy"))
        assert err.value.void
        assert (await b.execute_training(info.model_id, ops("optim_step", adam_params=AdamParams()))).step == 1

        other = await _session(b, tiny)
        o = Ops()
        d = sft_datum(tok.encode(TEXT))
        with pytest.raises(InvalidInputError, match="loss"):
            await b.execute_training(other.model_id, o("forward_backward", data=(d,), loss_fn="nope"))
        third = await _session(b, tiny)
        wrong_shape = Datum(model_input=ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [1, 2], "weights": [1.0, 1.0]})
        with pytest.raises(InvalidInputError, match="shape"):
            await b.execute_training(third.model_id, Ops()("forward", data=(wrong_shape,), loss_fn="cross_entropy"))
        too_long = sft_datum([10 + i % 300 for i in range(600)])
        with pytest.raises(InvalidInputError, match="context"):
            await b.execute_training((await _session(b, tiny)).model_id, Ops()("forward", data=(too_long,), loss_fn="cross_entropy"))
        with pytest.raises(InvalidInputError, match="rank"):
            await _session(b, tiny, rank=0)
        with pytest.raises(InvalidInputError, match="base model"):
            await b.create_training_session(TrainingSessionSpec(base_model="no-such-model"))
        await b.stop_session(info.model_id)
        with pytest.raises(SessionGoneError):
            await b.execute_training(info.model_id, ops("optim_step", adam_params=AdamParams()))
    finally:
        await b.aclose()


def test_packed_logprobs_equal_one_sequence_at_a_time(tiny_dir):
    from transformers import AutoModelForCausalLM

    from asyncsess_local.logprobs import _rows, packed_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    g = torch.Generator().manual_seed(0)
    lengths = [9, 1, 4, 9, 2, 7, 3, 1]
    seqs = [(torch.randint(0, 384, (n,), generator=g), torch.randint(0, 384, (n,), generator=g)) for n in lengths]
    rows = _rows(lengths)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert max(sum(lengths[i] for i in r) for r in rows) == 9 and len(rows) < len(lengths)  # really packed, never wider
    with torch.no_grad():
        packed = packed_logprobs(model, seqs, chunk=5)
        for (ids, tgt), got in zip(seqs, packed):
            logits = model(input_ids=ids[None]).logits[0].float()
            want = logits.log_softmax(-1).gather(-1, tgt[:, None])[:, 0]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        full = packed_logprobs(model, seqs, chunk=5, plain_head=False)
        for a, b in zip(packed, full):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _spoil_gradient(sess) -> None:
    """Put a NaN into the gradient a pass accumulated (legal inputs can no longer overflow it: weights and
    advantages are bounded by ``MAX_TOKEN_SCALE``; this is the safety net behind that bound)."""
    grad = next(p.grad for k, p in sess.params.items() if "lora_A" in k and p.grad is not None)
    grad.view(-1)[0] = float("nan")


async def test_a_non_finite_gradient_is_not_applied_and_the_session_lives_on(backend_factory, tiny):
    """The inf/NaN gradient was applied and the adapter's weights became NaN for good. Now optim_step refuses it
    (typed), leaves weights and AdamW state as they were, zeroes the gradient, and the session runs on."""
    from asyncsess.errors import NonFiniteGradientError

    b = backend_factory()
    try:
        await b.open()
        tok = b.get_tokenizer(tiny)
        good = sft_datum(tok.encode(TEXT))
        info = await _session(b, tiny)
        sess, ops, hp = b.engine.sessions[info.model_id], Ops(), AdamParams(learning_rate=1e-2)
        await b.execute_training(info.model_id, ops("forward_backward", data=(good,), loss_fn="cross_entropy"))
        await b.execute_training(info.model_id, ops("optim_step", adam_params=hp))
        weights = {k: p.detach().clone() for k, p in sess.params.items()}
        moments = {k: {n: t.clone() for n, t in s.items()} for k, s in sess.optimizer.state.items()}
        await b.execute_training(info.model_id, ops("forward_backward", data=(good,), loss_fn="cross_entropy"))
        _spoil_gradient(sess)
        with pytest.raises(NonFiniteGradientError) as err:
            await b.execute_training(info.model_id, ops("optim_step", adam_params=AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)))
        assert err.value.field == "gradient" and err.value.seq == 4 and err.value.operation == "optim_step"
        assert all(torch.equal(weights[k], p) for k, p in sess.params.items())
        assert all(torch.equal(moments[p][n], t) for p, s in sess.optimizer.state.items() for n, t in s.items())
        assert all(p.grad is None for p in sess.params.values()) and sess.step == 1
        # not poisoned: the next pass and step run, on a fresh gradient
        await b.execute_training(info.model_id, ops("forward_backward", data=(good,), loss_fn="cross_entropy"))
        assert (await b.execute_training(info.model_id, ops("optim_step", adam_params=hp))).step == 2
        assert all(torch.isfinite(p).all() and not torch.equal(weights[k], p) for k, p in sess.params.items() if "lora_B" in k)
    finally:
        await b.aclose()


async def test_a_non_finite_gradient_over_http_is_a_typed_400_and_the_client_goes_on(backend_factory, tiny):
    from asyncsess import ServiceClient
    from asyncsess.errors import NonFiniteGradientError
    from asyncsess_local.server import serve_in_thread

    backend = backend_factory()
    worker = serve_in_thread(backend, ["k"])
    try:
        async with ServiceClient(worker.url, api_key="k") as svc:
            tc = await svc.create_lora_training_client(tiny, rank=4)
            tok = tc.get_tokenizer()
            await tc.forward_backward([sft_datum(tok.encode(TEXT))], "cross_entropy")
            (sess,) = backend.engine.sessions.values()
            _spoil_gradient(sess)
            step = tc.optim_step(AdamParams(learning_rate=1e-2))
            after = tc.forward_backward([sft_datum(tok.encode(TEXT))], "cross_entropy")  # queued behind the step
            with pytest.raises(NonFiniteGradientError, match="not applied") as err:
                await step
            assert err.value.status_code == 400 and err.value.field == "gradient"
            assert (await after).metrics["loss:sum"] > 0
            assert (await tc.optim_step(AdamParams(learning_rate=1e-2))).step == 1
    finally:
        worker.stop()
