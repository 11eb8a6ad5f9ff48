"""``tinker://``: asyncsess's own client on the Tinker wire against ``asyncsess serve`` on mock://.

These are the mock:// client suite's checks (futures, ordering, exactly-once, checkpoints, sampling,
errors), with the server's mock backend as the white-box witness.
"""

from __future__ import annotations

import types

import anyio
import numpy as np
import pytest

from asyncsess import AdamParams, Datum, InvalidInputError, ModelInput, SamplingParams, ServiceClient, UnsupportedError
from asyncsess.backends import ForwardBackwardOp, ForwardOp, OptimStepOp, TrainingSessionSpec, load_backend
from asyncsess.errors import AsyncSessError
from asyncsess.rl.data import center_advantages, rl_datum
from tests.client.helpers import sft_datum

from .conftest import API_KEY, Server

pytestmark = [pytest.mark.tinker, pytest.mark.anyio]

BASE = "mock/bigram-tiny"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def url_of(server: Server, **query: str) -> str:
    q = "&".join(f"{k}={v}" for k, v in {"api_key": API_KEY, **query}.items())
    return server.url.replace("http://", "tinker://") + "?" + q


def test_url_forms_and_api_key_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    b = load_backend("tinkers://example.org/prefix?api_key=tml-a")
    assert (b.base_url, b.api_key) == ("https://example.org/prefix", "tml-a")
    monkeypatch.setenv("TINKER_API_KEY", "tml-env")
    assert load_backend("tinker://127.0.0.1:9").api_key == "tml-env"
    assert load_backend("tinker://127.0.0.1:9", api_key="tml-opt").api_key == "tml-opt"
    with pytest.raises(InvalidInputError, match="url"):
        load_backend("tinker:///nohost")


async def test_futures_pipeline_and_order(mock_server: Server) -> None:
    async with ServiceClient(url_of(mock_server)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        f1 = tc.forward_backward([sft_datum([1, 40, 41, 42])], "cross_entropy")
        f2 = tc.optim_step(AdamParams(learning_rate=0.1))
        f3 = tc.forward_backward([sft_datum([1, 40, 41, 42])], "cross_entropy")
        assert (f1.seq, f2.seq, f3.seq) == (1, 2, 3)
        out3, out1 = await f3, await f1
        assert out3.loss < out1.loss, "f3 must run after the optim step"
        assert out1.usage.training_tokens == 3 and (await f2).metrics is not None
        backend_id = mock_server.door.models[tc.model_id].backend_id
        applied = [(seq, kind) for sid, seq, kind in mock_server.backend.applied_log if sid == backend_id]
        assert applied == [(1, "forward_backward"), (2, "optim_step"), (3, "forward_backward")]


async def test_training_matches_mock_directly(mock_server: Server) -> None:
    """The same ops through tinker:// and straight on mock:// give the same losses."""
    data = [sft_datum([3, 10, 11, 12, 13]), sft_datum([4, 20, 21])]

    async def losses(url: str) -> list[float]:
        async with ServiceClient(url) as svc:
            tc = await svc.create_lora_training_client(BASE, rank=4)
            out = []
            for _ in range(3):
                fb = tc.forward_backward(data, "cross_entropy")
                await tc.optim_step(AdamParams(learning_rate=0.05))
                out.append((await fb).loss)
            return out

    wire, direct = await losses(url_of(mock_server)), await losses("mock://")
    assert wire == pytest.approx(direct, rel=1e-6)


async def test_checkpoint_resume_with_optimizer_is_bit_exact(mock_server: Server) -> None:
    backend = mock_server.backend
    async with ServiceClient(url_of(mock_server)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        for _ in range(2):
            tc.forward_backward([sft_datum([1, 40, 41, 42])], "cross_entropy")
            await tc.optim_step(AdamParams(learning_rate=0.1))
        saved = await tc.save_state("wire-ckpt")
        assert saved.path.startswith("tinker://") and saved.path.endswith("/weights/wire-ckpt")
        exact = await svc.create_training_client_from_state_with_optimizer(saved.path)
        fresh = await svc.create_training_client_from_state(saved.path)
        ids = {c: mock_server.door.models[c.model_id].backend_id for c in (tc, exact, fresh)}
        assert np.array_equal(backend.weights(ids[tc]), backend.weights(ids[exact]))
        assert backend.optimizer_state(ids[exact])[2] == 2 and backend.optimizer_state(ids[fresh])[2] == 0
        listed = await svc.list_checkpoints(tc.model_id)
        assert [c.checkpoint_id for c in listed] == ["weights/wire-ckpt"] and listed[0].checkpoint_type == "training"


async def test_a_saves_ttl_and_overwrite_reach_the_server(mock_server: Server) -> None:
    """Both were dropped from the request: the checkpoint never expired, and overwrite=True was a refusal."""
    async with ServiceClient(url_of(mock_server)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        state = await tc.save_state("ttl-state", ttl_seconds=3600)
        sampler = await tc.save_weights_for_sampler("ttl-sampler", ttl_seconds=7200)
        listed = {c.tinker_path: c for c in await svc.list_checkpoints(tc.model_id)}
        for path, ttl in ((state.path, 3600), (sampler.path, 7200)):
            expires_at = listed[path].expires_at
            assert expires_at is not None and abs(expires_at - listed[path].time - ttl) <= 1
        with pytest.raises(InvalidInputError, match="overwrite"):
            await tc.save_state("ttl-state")
        assert (await tc.save_state("ttl-state", overwrite=True)).path == state.path  # a new checkpoint: no TTL
        listed = {c.tinker_path: c for c in await svc.list_checkpoints(tc.model_id)}
        assert listed[state.path].expires_at is None and listed[sampler.path].expires_at is not None


async def test_sampling_logprobs_and_sampler_refresh(mock_server: Server) -> None:
    async with ServiceClient(url_of(mock_server)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        sc = await tc.save_weights_and_get_sampling_client()
        res = await sc.sample([5, 6], 3, SamplingParams(max_tokens=4, seed=1))
        assert len(res.sequences) == 3 and all(len(s.tokens) <= 4 and len(s.logprobs or []) == len(s.tokens) for s in res.sequences)
        ids = [s.sequence_id for s in res.sequences]  # the ids the server gave the request (they were None)
        assert all(isinstance(i, str) and i for i in ids) and len(set(ids)) == 3
        before = await sc.compute_logprobs([5, 6, 42])
        assert before[0] is None and len(before) == 3
        for _ in range(3):
            tc.forward_backward([rl_datum([5, 6], [42], [-5.0], 1.0)], "importance_sampling")
            await tc.optim_step(AdamParams(learning_rate=0.2))
        sc2 = await tc.save_weights_and_get_sampling_client()
        after = await sc2.compute_logprobs([5, 6, 42])
        assert after[2] > before[2] + 0.1
        assert (await sc.compute_logprobs([5, 6, 42]))[2] == pytest.approx(before[2]), "the old sampler keeps its weights"


async def test_a_lost_sample_answer_is_fetched_under_the_same_seq_id(mock_server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """As Tinker's SDK does, a retried sample keeps its seq_id: the server returns the future it has, and the
    sample is not drawn again."""
    from asyncsess import RetryPolicy, TransientError

    async with ServiceClient(url_of(mock_server), retry=RetryPolicy(initial_backoff=0.001, jitter=0.0)) as svc:
        sc = await svc.create_sampling_client(base_model=BASE)
        backend = svc.backend
        real_send = backend._send
        seq_ids: list[int] = []
        lose = iter([True])

        async def flaky(method: str, path: str, **kw):
            if path == "/api/v1/asample":
                seq_ids.append(kw["json"]["seq_id"])
            resp = await real_send(method, path, **kw)
            if path == "/api/v1/retrieve_future" and next(lose, False):
                raise TransientError("connection dropped while reading", lost_response=True)
            return resp

        monkeypatch.setattr(backend, "_send", flaky)
        drawn = mock_server.backend.calls["sample"]
        first = await sc.sample([5, 6], 2, SamplingParams(max_tokens=4))  # no seed: drawing again would differ
        assert svc.retries == 1 and seq_ids == [0, 0], "the retry re-sent the same seq_id"
        assert mock_server.backend.calls["sample"] == drawn + 1, "the server answered the retry from its store"
        second = await sc.sample([5, 6], 2, SamplingParams(max_tokens=4))
        assert seq_ids == [0, 0, 1] and mock_server.backend.calls["sample"] == drawn + 2, "a new request is a new seq_id"
        assert len(first.sequences) == len(second.sequences) == 2


async def test_rl_loop_reward_rises(mock_server: Server) -> None:
    """A GRPO loop on token ids (reward: how often token 42 appears) over tinker://."""
    async with ServiceClient(url_of(mock_server)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=8, seed=0)
        sampler = await tc.save_weights_and_get_sampling_client()
        means = []
        for step in range(6):
            res = await sampler.sample([5, 6, 7], 16, SamplingParams(max_tokens=4, seed=step, stop=[]))
            rewards = [sum(t == 42 for t in s.tokens) / 4 for s in res.sequences]
            means.append(sum(rewards) / len(rewards))
            adv = center_advantages([r + 1e-3 * i for i, r in enumerate(rewards)])
            data = [rl_datum([5, 6, 7], s.tokens, s.logprobs or [], a) for s, a in zip(res.sequences, adv)]
            push = await sampler.compute_logprobs([5, 6, 7, 42, 42, 42, 42])
            data.append(rl_datum([5, 6, 7], [42, 42, 42, 42], [float(x) for x in push[3:]], 1.0))  # on-policy ratio 1
            tc.forward_backward(data, "importance_sampling")
            await tc.optim_step(AdamParams(learning_rate=1.0))
            sampler = await tc.save_weights_and_get_sampling_client()
        assert sum(means[-2:]) / 2 > sum(means[:2]) / 2 + 0.1, means


async def test_bad_input_is_typed_and_consumes_nothing(mock_server: Server) -> None:
    async with ServiceClient(url_of(mock_server)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        bad_shape = Datum(model_input=ModelInput.from_ints([1, 40]), loss_fn_inputs={"target_tokens": [40], "weights": [1.0]})
        with pytest.raises(InvalidInputError, match="target_tokens"):
            tc.forward_backward([bad_shape], "cross_entropy")  # refused at call time, before a seq
        assert (await tc.forward_backward([sft_datum([1, 40, 41])], "cross_entropy")).loss > 0
        with pytest.raises(InvalidInputError, match="vocabulary"):
            tc.forward_backward([sft_datum([1, 2, 10**6])], "cross_entropy")  # checked against the server's vocabulary
        assert (await tc.forward_backward([sft_datum([1, 40, 41])], "cross_entropy")).loss > 0  # nothing was consumed
        with pytest.raises(InvalidInputError, match="path"):
            await svc.create_training_client_from_state(f"tinker://{tc.model_id}/weights/never")
    with pytest.raises(AsyncSessError, match="X-API-Key"):
        async with ServiceClient(mock_server.url.replace("http://", "tinker://") + "?api_key=tml-wrong"):
            pass


async def test_what_the_wire_cannot_carry_is_refused_before_numbering(mock_server: Server) -> None:
    """merge_weights=True, a LoRA+ ratio and a token id past int32 were refused only when the op ran: numbered but
    never sent, the op poisoned the training client for good (and the server waited for its seq_id)."""
    async with ServiceClient(url_of(mock_server)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        for call, field in [
            (lambda: tc.save_weights_for_sampler("merged", merge_weights=True), "merge_weights"),
            (lambda: tc.optim_step(AdamParams(learning_rate=0.1, lora_plus_lr_ratio=4.0)), "adam_params.lora_plus_lr_ratio"),
        ]:
            with pytest.raises(UnsupportedError) as err:
                call()
            assert err.value.field == field
        wide = ForwardOp(seq=1, idempotency_key="k", data=(sft_datum([1, 2**31, 41]),), loss_fn="cross_entropy")
        with pytest.raises(InvalidInputError, match="int32"):
            svc.backend.precheck(tc.model_id, wide)  # the door's vocabulary catches it first; Tinker's lists none
        assert tc.current_sequence_number == 0
        fb, step = tc.forward_backward([sft_datum([1, 40, 41])], "cross_entropy"), tc.optim_step(AdamParams(learning_rate=0.1))
        assert ((await fb).loss > 0, (await step).metrics is not None, step.seq) == (True, True, 2)


async def test_server_dedupes_a_resent_op(mock_server: Server) -> None:
    """The same (model_id, seq_id) delivered twice runs once; a changed body under it is refused (409)."""
    from asyncsess.errors import ConflictError

    b = load_backend(url_of(mock_server))
    await b.open()
    try:
        info = await b.create_training_session(TrainingSessionSpec(BASE, rank=4))
        op = ForwardBackwardOp(seq=1, idempotency_key="k1", data=(sft_datum([1, 40, 41]),), loss_fn="cross_entropy")
        async with anyio.create_task_group() as tg:
            outs: list[float] = []

            async def run() -> None:
                outs.append((await b.execute_training(info.model_id, op)).metrics["loss:sum"])

            tg.start_soon(run)
            tg.start_soon(run)
        assert outs[0] == outs[1]
        backend_id = mock_server.door.models[info.model_id].backend_id
        assert [s for sid, s, _ in mock_server.backend.applied_log if sid == backend_id] == [1]
        changed = ForwardBackwardOp(seq=1, idempotency_key="k2", data=(sft_datum([1, 40, 42]),), loss_fn="cross_entropy")
        with pytest.raises(ConflictError):
            await b.execute_training(info.model_id, changed)
    finally:
        await b.aclose()


async def test_leaving_the_client_stops_the_server_side_sessions(mock_server: Server) -> None:
    from asyncsess_mock import MockBackend

    with pytest.raises(RuntimeError, match="boom"):
        async with ServiceClient(url_of(mock_server)) as svc:
            tc = await svc.create_lora_training_client(BASE, rank=4)
            sc = await svc.create_sampling_client(base_model=BASE)
            await sc.sample([5, 6], 1, SamplingParams(max_tokens=2))
            ids = {mock_server.door.models[tc.model_id].backend_id, mock_server.door.samplers[sc.sampler_id].backend_id}
            assert ids <= set(MockBackend.open_sessions())
            raise RuntimeError("boom")
    assert not ids & set(MockBackend.open_sessions())


@pytest.mark.parametrize(
    "bad", [None, {"kind": "optim_step", "seq": 1}, types.SimpleNamespace(kind="optim_step", seq=1, idempotency_key="k")]
)
async def test_an_object_that_is_not_an_op_record_is_refused_before_it_takes_a_sequence_number(mock_server: Server, bad: object) -> None:
    b = load_backend(url_of(mock_server))
    await b.open()
    try:
        info = await b.create_training_session(TrainingSessionSpec(BASE, rank=4))
        with pytest.raises(InvalidInputError) as err:
            await b.execute_training(info.model_id, bad)  # type: ignore[arg-type]
        assert err.value.field == "op"
        # nothing reached the server: seq_id 1 is still the model's first op
        out = await b.execute_training(info.model_id, OptimStepOp(seq=1, idempotency_key="k1"))
        assert out.metrics is not None
        backend_id = mock_server.door.models[info.model_id].backend_id
        assert [(s, k) for sid, s, k in mock_server.backend.applied_log if sid == backend_id] == [(1, "optim_step")]
    finally:
        await b.aclose()


async def test_save_fields_listing_and_delete_over_the_wire(mock_server: Server) -> None:
    """``save_state(name, ttl_seconds, overwrite, user_metadata)`` reaches the server (tinker:// sent the name only,
    so an overwrite failed on the server and poisoned the model), the listing reads them back, and a checkpoint
    is deleted by its path (tinker:// could not delete)."""
    async with ServiceClient(url_of(mock_server)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        datum = sft_datum([1, 40, 41, 42])
        saved = await tc.save_state("kept", ttl_seconds=7200, user_metadata={"step": "0"})
        tc.forward_backward([datum], "cross_entropy")
        await tc.optim_step(AdamParams(learning_rate=0.1))
        after_step = (await tc.forward([datum], "cross_entropy")).loss
        assert (await tc.save_state("kept", overwrite=True, user_metadata={"step": "1"})).path == saved.path
        assert (await tc.forward([datum], "cross_entropy")).loss == after_step  # not poisoned
        resumed = await svc.create_training_client_from_state(saved.path)
        assert (await resumed.forward([datum], "cross_entropy")).loss == after_step  # the overwrite holds the new weights
        sampler = await tc.save_weights_for_sampler("s", ttl_seconds=3600)
        listed = {c.checkpoint_id: c for c in await svc.list_checkpoints(tc.model_id)}
        assert listed["weights/kept"].user_metadata == {"step": "1"} and listed["weights/kept"].expires_at is None
        ck = listed["sampler_weights/s"]
        assert ck.expires_at is not None and ck.expires_at - ck.time == pytest.approx(3600, abs=2)
        await svc.delete_checkpoint(sampler.path)
        assert [c.checkpoint_id for c in await svc.list_checkpoints(tc.model_id)] == ["weights/kept"]


async def test_topk_and_target_logprobs_over_the_wire_equal_mock_directly(mock_server: Server) -> None:
    """tinker:// sent neither top-k nor target log-probs (the client refused them as not returned); they now
    travel both ways and equal mock://'s own."""
    prompt, ids = [5, 9, 13, 17, 21], np.array([[9, -1], [13, 1], [-1, -1], [21, 22]])

    async def sample(url: str):
        async with ServiceClient(url) as svc:
            sc = await svc.create_sampling_client(base_model=BASE)
            params = SamplingParams(max_tokens=3, seed=1)
            return await sc.sample(
                prompt,
                2,
                params,
                True,
                topk_prompt_logprobs=3,
                topk_sample_logprobs=2,
                target_prompt_logprobs=ids,
                prompt_logprobs_last_n=3,
            )

    got, want = await sample(url_of(mock_server)), await sample("mock://")
    assert got.topk_prompt_logprobs[:2] == [None, None]
    for g, w in [(got.topk_prompt_logprobs, want.topk_prompt_logprobs)] + [
        (a.topk_logprobs, b.topk_logprobs) for a, b in zip(got.sequences, want.sequences)
    ]:
        assert [r and [t for t, _ in r] for r in g] == [r and [t for t, _ in r] for r in w]
        assert [r and [lp for _, lp in r] for r in g] == [r and pytest.approx([lp for _, lp in r], abs=1e-6) for r in w]
    assert got.target_prompt_logprobs.shape == [4, 2]
    assert got.target_prompt_logprobs.data == pytest.approx(want.target_prompt_logprobs.data, abs=1e-6)


async def test_k_targets_per_position_over_the_wire_equal_mock_directly(mock_server: Server) -> None:
    """tinker:// listed no multi-target losses, so the client refused (N, K) cross-entropy targets (and the
    custom losses lowered to it) that the server takes: the door now says which losses take them, and a
    forward_backward and a custom loss on (N, K) targets give mock://'s own log-probs and gradients."""
    targets = np.array([[9, 10], [13, 1], [17, 3], [21, 22]])
    datum = Datum(
        model_input=ModelInput.from_ints([5, 9, 13, 17]),
        loss_fn_inputs={"target_tokens": targets, "weights": np.array([[1.0, 0.5], [0.0, 1.0], [1.0, 1.0], [0.2, 0.0]])},
    )

    def loss(data, logprobs):  # a probability loss over the K choices at each position, as the decisions recipe's
        return sum(((lp.softmax(-1)[:, 0] - 0.9) ** 2).sum() for lp in logprobs), {}

    async def run(url: str):
        async with ServiceClient(url) as svc:
            caps = await svc.get_server_capabilities()
            tc = await svc.create_lora_training_client(BASE, rank=4, seed=3)
            fb = await tc.forward_backward([datum], "cross_entropy")
            await tc.optim_step(AdamParams(learning_rate=0.1))
            custom = await tc.forward_backward_custom([datum], loss)
            return caps.multi_target_losses, fb, custom

    (caps, fb, custom), (want_caps, want_fb, want_custom) = await run(url_of(mock_server)), await run("mock://")
    assert caps == want_caps and "cross_entropy" in caps
    for got, want in [(fb, want_fb), (custom, want_custom)]:
        assert got.loss_fn_outputs[0]["logprobs"].shape == [4, 2]
        assert got.loss_fn_outputs[0]["logprobs"].data == pytest.approx(want.loss_fn_outputs[0]["logprobs"].data, abs=1e-6)
    assert custom.metrics["loss:sum"] == pytest.approx(want_custom.metrics["loss:sum"], rel=1e-5)


async def test_a_refusal_keeps_the_field_and_fix_the_server_named(mock_server: Server) -> None:
    """The door answers a refusal as ``{"error", "field", "fix"}``; tinker:// kept only the message (``err.field`` was
    None and the fix was lost) for every status but 409."""
    from asyncsess.backends import SamplerSpec

    b = load_backend(url_of(mock_server))
    await b.open()
    try:
        with pytest.raises(InvalidInputError) as err:
            await b.create_training_session(TrainingSessionSpec(BASE, rank=4, from_path="tinker://0-0-0:train:0/weights/never"))
        assert err.value.field == "path" and err.value.fix and "save_state" in err.value.fix, err.value
        with pytest.raises(InvalidInputError) as err:
            await b.create_sampler(SamplerSpec(model_path="tinker://0-0-0:train:0/sampler_weights/never"))
        assert err.value.field == "model_path" and str(err.value).startswith("model_path: "), err.value
    finally:
        await b.aclose()
