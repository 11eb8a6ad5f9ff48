"""The HTTP worker and the http:// backend: a round trip, typed errors, auth and ownership,
4xx (never 5xx) on bad input including a hypothesis fuzz, and the OpenAI-compatible chat API."""

from __future__ import annotations

import httpx
import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from asyncsess.backends import SampleRequest, SamplerSpec, TrainingSessionSpec  # noqa: E402
from asyncsess.errors import InvalidInputError, PoisonedError, SessionGoneError  # noqa: E402
from asyncsess.types import AdamParams, Datum, ModelInput, SamplingParams  # noqa: E402

from .helpers import DEVICE_KW, Ops, sft_datum  # noqa: E402

pytestmark = pytest.mark.local

KEY, OTHER = "key-a", "key-b"


@pytest.fixture(scope="module")
def worker(tiny, tmp_path_factory):
    from asyncsess_local.embedded import LocalBackend
    from asyncsess_local.server import serve_in_thread

    backend = LocalBackend(model=tiny, **DEVICE_KW, checkpoint_dir=str(tmp_path_factory.mktemp("worker-ckpt")), gap_timeout=5)
    w = serve_in_thread(backend, [KEY, OTHER])
    w.backend = backend
    yield w
    w.stop()


def _client(worker, key=KEY):
    from asyncsess.backends.http import HttpBackend

    return HttpBackend(worker.url, api_key=key)


@pytest.mark.anyio
async def test_round_trip(worker, tiny):
    b = _client(worker)
    try:
        caps = await b.capabilities()
        assert caps.supported_models[0].model_name == tiny and caps.supported_models[0].vocab_size == 384
        tok = b.get_tokenizer(tiny)
        d = sft_datum(tok.encode("what is 2 plus 3? the answer is 5."))
        info = await b.create_training_session(TrainingSessionSpec(base_model=tiny, rank=4, seed=0))
        ops = Ops()
        losses = []
        for _ in range(4):
            out = await b.execute_training(info.model_id, ops("forward_backward", data=(d,), loss_fn="cross_entropy"))
            step = await b.execute_training(info.model_id, ops("optim_step", adam_params=AdamParams(learning_rate=2e-2)))
            losses.append(out.loss)
        assert step.step == 4 and losses[-1] < losses[0]
        assert len(out.loss_fn_outputs[0]["logprobs"].data) == d.model_input.length

        # a repeated delivery returns the stored result without running the op again
        engine = worker.backend.engine
        passes = engine.stats["passes"]
        op = ops("forward_backward", data=(d,), loss_fn="cross_entropy")
        first = await b.execute_training(info.model_id, op)
        again = await b.execute_training(info.model_id, op)
        assert first == again and engine.stats["passes"] == passes + 1

        saved = await b.execute_training(info.model_id, ops("save_weights", name="http"))
        sampler = await b.create_sampler(SamplerSpec(model_path=saved.path))
        prompt = tok.encode("the answer is")
        res = await b.sample(sampler, SampleRequest(tuple(prompt), 2, SamplingParams(max_tokens=5, temperature=0.0, stop=[])))
        assert [len(s.tokens) for s in res.sequences] == [5, 5] and res.usage.decode_tokens == 10
        # a sample re-sent under its request_id (a retry after a lost answer) is answered from the worker's store
        retry = SampleRequest(tuple(prompt), 2, SamplingParams(max_tokens=5, temperature=1.5, stop=[]), request_id="r-http")
        drawn = engine.stats["sample_rows"]
        assert await b.sample(sampler, retry) == await b.sample(sampler, retry)
        assert engine.stats["sample_rows"] == drawn + 2, "its 2 rows were decoded once"
        lp = await b.compute_logprobs(sampler, prompt + res.sequences[0].tokens)
        assert lp[0] is None and lp[len(prompt) :] == pytest.approx(res.sequences[0].logprobs, abs=1e-4)
        listed = await b.list_checkpoints(info.model_id)
        assert [c.path for c in listed] == [saved.path]
        await b.heartbeat(info.model_id)
        await b.stop_session(info.model_id)
        with pytest.raises(SessionGoneError):
            await b.heartbeat(info.model_id)
    finally:
        await b.aclose()


@pytest.mark.anyio
async def test_typed_errors_cross_http(worker, tiny):
    b = _client(worker)
    try:
        info = await b.create_training_session(TrainingSessionSpec(base_model=tiny, rank=2))
        ops = Ops()
        bad = Datum(model_input=ModelInput.from_ints([1, 2, 5000]), loss_fn_inputs={"target_tokens": [1, 2, 3], "weights": [1.0] * 3})
        with pytest.raises(InvalidInputError) as exc:
            await b.execute_training(info.model_id, ops("forward_backward", data=(bad,), loss_fn="cross_entropy"))
        assert exc.value.field == "data[0]" and exc.value.seq == 1 and exc.value.void  # refused before anything ran; seq 1 used up
        assert (await b.execute_training(info.model_id, ops("optim_step", adam_params=AdamParams()))).step == 1
        # a failure while running (not refusable up front) poisons the ops after it
        engine = worker.backend.engine
        engine.sessions[info.model_id].failed = RuntimeError("injected")
        with pytest.raises(PoisonedError):
            await b.execute_training(info.model_id, ops("optim_step", adam_params=AdamParams()))
        with pytest.raises(SessionGoneError):
            await b.execute_training("lora-nope", Ops()("optim_step", adam_params=AdamParams()))
        with pytest.raises(InvalidInputError, match="path"):
            await b.create_sampler(SamplerSpec(model_path="local:///etc"))
    finally:
        await b.aclose()


def test_auth_and_ownership(worker, tiny):
    with httpx.Client(base_url=worker.url, timeout=60) as c:
        assert c.get("/v1/capabilities").status_code == 401
        assert c.get("/v1/capabilities", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/v1/capabilities", headers={"X-API-Key": KEY}).status_code == 200
        mine = {"Authorization": f"Bearer {KEY}"}
        theirs = {"Authorization": f"Bearer {OTHER}"}
        info = c.post("/v1/sessions", json={"base_model": tiny, "rank": 2}, headers=mine).json()
        sid = info["model_id"]
        saved = c.post(f"/v1/sessions/{sid}/ops", json={"kind": "save_state", "seq": 1, "idempotency_key": "k1"}, headers=mine)
        assert saved.status_code == 200
        path = saved.json()["result"]["path"]
        # the other key sees nothing of it
        r = c.post(f"/v1/sessions/{sid}/ops", json={"kind": "save_state", "seq": 2, "idempotency_key": "k2"}, headers=theirs)
        assert r.status_code == 404 and r.json()["error"]["type"] == "SessionGoneError"
        assert c.post(f"/v1/sessions/{sid}/heartbeat", headers=theirs).status_code == 404
        assert c.post("/v1/sessions", json={"base_model": tiny, "from_path": path}, headers=theirs).status_code == 400
        assert c.post("/v1/samplers", json={"model_path": path}, headers=theirs).status_code == 400
        assert c.get("/v1/checkpoints", headers=theirs).json() == []
        assert path in [x["path"] for x in c.get("/v1/checkpoints", headers=mine).json()]
        assert [x["path"] for x in c.get("/v1/checkpoints", params={"session_id": sid}, headers=mine).json()] == [path]
        c.delete(f"/v1/sessions/{sid}", headers=theirs)  # a no-op for a stranger
        assert c.post(f"/v1/sessions/{sid}/heartbeat", headers=mine).status_code == 204
        assert c.post("/v1/sessions", json={"base_model": tiny, "from_path": path}, headers=mine).status_code == 200


def test_a_taken_name_is_refused_voiding_its_seq_and_ephemeral_saves_stay_off_disk(worker, tiny):
    """Over HTTP: a save under a taken name is a 409 naming ``overwrite`` that uses up its seq (void); overwrite=True
    replaces it. An ephemeral save (a sampler refresh), merged or not, is an in-memory snapshot: never listed, no
    directory; an ephemeral save_state is refused (it is always durable)."""
    h = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=worker.url, timeout=60, headers=h) as c:
        sid = c.post("/v1/sessions", json={"base_model": tiny, "rank": 2}).json()["model_id"]

        def op(seq, kind, **body):
            return c.post(f"/v1/sessions/{sid}/ops", json={"kind": kind, "seq": seq, "idempotency_key": f"k{seq}", **body})

        saved = op(1, "save_state", name="a")
        assert saved.status_code == 200, saved.text
        path = saved.json()["result"]["path"]
        r = op(2, "save_state", name="a")
        assert r.status_code == 409 and r.json()["error"]["type"] == "ConflictError" and r.json()["error"]["field"] == "overwrite", r.text
        assert "overwrite=True" in r.json()["error"]["fix"] and r.json()["error"]["void"] is True  # seq 2 is used up
        assert op(2, "save_state", name="a").json() == r.json()  # a re-delivery gets the same refusal
        r = op(3, "save_weights", ephemeral=True, merge_weights=True)
        assert r.status_code == 200, r.text
        snapshot = r.json()["result"]["path"]
        assert snapshot.startswith("local://ephemeral/")
        assert c.post("/v1/samplers", json={"model_path": snapshot}).status_code == 200
        assert op(4, "optim_step", adam_params={}).json()["result"]["step"] == 1
        r = op(5, "save_state", name="a", overwrite=True)
        assert r.status_code == 200 and r.json()["result"]["path"] == path and r.json()["result"]["step"] == 1, r.text
        r = op(6, "save_state", ephemeral=True)
        assert r.status_code == 400 and r.json()["error"]["field"] == "ephemeral", r.text
        listed = c.get("/v1/checkpoints", params={"session_id": sid}).json()
        assert [(x["path"], x["step"]) for x in listed] == [(path, 1)]
        assert sorted(p.name for p in (worker.backend.engine.store.root / sid).iterdir()) == ["state"]


BAD_BODIES = [
    ("POST", "/v1/sessions", b"{not json"),
    ("POST", "/v1/sessions", [1, 2]),
    ("POST", "/v1/sessions", {"base_model": 5}),
    ("POST", "/v1/sessions", {"base_model": "nope"}),
    ("POST", "/v1/sessions", {"base_model": "TINY", "rank": 100000}),
    ("POST", "/v1/samplers", {"model_path": "local://../../etc/passwd"}),
    ("POST", "/v1/samplers", {"base_model": "no/such-model-anywhere"}),
    ("POST", "/v1/samplers/nope/sample", {"prompt": [1], "num_samples": 1, "sampling_params": {}}),
    ("POST", "/v1/samplers/nope/logprobs", {"tokens": "abc"}),
    ("POST", "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/chat/completions", {"model": "TINY", "messages": []}),
    ("GET", "/v1/tokenizer?base_model=nope", None),
]


def test_bad_requests_get_4xx_naming_the_field(worker, tiny):
    h = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=worker.url, timeout=60, headers=h) as c:
        sid = c.post("/v1/sessions", json={"base_model": tiny, "rank": 2}, headers=h).json()["model_id"]
        smp = c.post("/v1/samplers", json={"base_model": tiny}).json()["sampler_id"]
        ops = [
            {"kind": "forward_backward", "seq": 1, "idempotency_key": "a", "loss_fn": "nope", "data": []},
            {"kind": "bogus", "seq": 1, "idempotency_key": "a"},
            {"kind": "forward", "seq": "x", "idempotency_key": "a"},
            {"kind": "load_state", "seq": 1, "idempotency_key": "a", "path": "local:///etc"},
        ]
        cases = [(m, p, b.replace("TINY", tiny) if isinstance(b, str) else b) for m, p, b in BAD_BODIES]
        cases = [(m, p.replace("TINY", tiny), _sub(b, tiny)) for m, p, b in cases]
        cases += [("POST", f"/v1/sessions/{sid}/ops", op) for op in ops]
        cases += [
            ("POST", f"/v1/samplers/{smp}/sample", {"prompt": [1, 10**7], "num_samples": 1, "sampling_params": {}}),
            ("POST", f"/v1/samplers/{smp}/sample", {"prompt": [1], "num_samples": 1, "sampling_params": {"top_k": 0}}),
            ("POST", f"/v1/samplers/{smp}/sample", {"prompt": [1] * 600, "num_samples": 1, "sampling_params": {}}),
            ("POST", f"/v1/samplers/{smp}/sample", {"prompt": [1], "num_samples": 1, "sampling_params": {"bogus": 1}}),
            ("POST", f"/v1/samplers/{smp}/logprobs", {"tokens": []}),
        ]
        for method, path, body in cases:
            kw = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
            r = c.request(method, path, **kw)
            assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text)
            err = r.json()["error"]
            assert err["type"] and err["message"], (path, body, err)


def _sub(body, tiny):
    if isinstance(body, dict):
        return {k: _sub(v, tiny) for k, v in body.items()}
    if isinstance(body, list):
        return [_sub(v, tiny) for v in body]
    return tiny if body == "TINY" else body


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_op_like = st.fixed_dictionaries(
    {"kind": st.sampled_from(["forward", "forward_backward", "optim_step", "save_state", "save_weights", "load_state", "x"])},
    optional={
        "seq": st.integers(-3, 1) | st.text(max_size=3),  # a later seq is a legal gap (it waits, then 503)
        "idempotency_key": st.text(max_size=5),
        "loss_fn": st.sampled_from(["cross_entropy", "ppo", "dro", "zzz"]),
        "loss_fn_config": st.dictionaries(st.sampled_from(["beta", "clip_low_threshold", "x"]), st.floats(-5, 5) | st.text(max_size=2)),
        "data": st.lists(
            st.fixed_dictionaries(
                {"model_input": st.lists(st.integers(-5, 500), max_size=6)},
                optional={
                    "loss_fn_inputs": st.dictionaries(
                        st.sampled_from(["target_tokens", "weights", "advantages", "logprobs", "junk"]),
                        st.lists(st.integers(-5, 500) | st.floats(-3, 3), max_size=6),
                    )
                },
            ),
            max_size=3,
        ),
        "adam_params": _json,
        "name": st.text(max_size=10),
        "path": st.text(max_size=20),
    },
)
_sample_like = st.fixed_dictionaries(
    {},
    optional={
        "prompt": st.lists(st.integers(-5, 1000), max_size=8) | _json,
        "num_samples": st.integers(-2, 3),
        "sampling_params": st.dictionaries(
            st.sampled_from(["max_tokens", "temperature", "top_p", "top_k", "stop", "seed"]),
            st.integers(-3, 700) | st.floats(-1, 3) | st.text(max_size=3) | st.lists(st.integers(-1, 500), max_size=2),
        ),
    },
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(op=_op_like, sample=_sample_like, anything=_json)
def test_fuzzed_requests_never_get_a_5xx(worker, tiny, op, sample, anything):
    h = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=worker.url, timeout=120, headers=h) as c:
        sid = c.post("/v1/sessions", json={"base_model": tiny, "rank": 1}).json()["model_id"]
        smp = c.post("/v1/samplers", json={"base_model": tiny}).json()["sampler_id"]
        try:
            for method, path, body in [
                ("POST", f"/v1/sessions/{sid}/ops", op),
                ("POST", f"/v1/samplers/{smp}/sample", sample),
                ("POST", "/v1/sessions", anything),
                ("POST", "/v1/samplers", anything),
                ("POST", f"/v1/samplers/{smp}/logprobs", anything),
                ("POST", "/v1/chat/completions", anything),
            ]:
                r = c.request(method, path, json=body)
                assert r.status_code < 500, (path, body, r.text)
        finally:
            c.delete(f"/v1/sessions/{sid}")
            c.delete(f"/v1/sessions/{smp}")


def test_openai_client_chat_and_stream(worker, tiny):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{worker.url}/v1", api_key=KEY)
    assert tiny in [m.id for m in client.models.list().data]
    out = client.chat.completions.create(
        model=tiny, messages=[{"role": "user", "content": "what is 2 plus 3?"}], max_tokens=8, temperature=0.0, n=2
    )
    assert len(out.choices) == 2 and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == out.choices[1].message.content
    assert out.usage.prompt_tokens > 0 and 0 < out.usage.completion_tokens <= 16
    stream = client.chat.completions.create(
        model=tiny, messages=[{"role": "user", "content": "what is 2 plus 3?"}], max_tokens=8, temperature=0.0, stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == out.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{worker.url}/v1", api_key="wrong").models.list()


@pytest.mark.anyio
async def test_a_save_the_disk_fails_is_insufficient_storage_and_the_client_goes_on(worker, tiny, monkeypatch):
    """Over http:// a save whose write hit ENOSPC came back a 500 ServerError, and the ops numbered after it were
    PoisonedErrors. It is an InsufficientStorageError (void, not retried) and the client's later ops run."""
    import errno

    import safetensors.torch

    import asyncsess

    real = safetensors.torch.save_file

    def full_disk(tensors, filename, metadata=None):
        if str(filename).endswith("optimizer.safetensors"):
            raise OSError(errno.ENOSPC, "No space left on device", str(filename))
        return real(tensors, filename, metadata=metadata)

    async with asyncsess.ServiceClient(worker.url, api_key=KEY, heartbeat_interval=0) as svc:
        tc = await svc.create_lora_training_client(tiny, rank=2, seed=0)
        monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
        saved = tc.save_state("full")
        step = tc.optim_step(AdamParams(learning_rate=1e-2))  # numbered after it
        with pytest.raises(asyncsess.InsufficientStorageError) as err:
            await saved
        assert err.value.void and err.value.fix and not asyncsess.is_retryable(err.value)
        assert (await step).step == 1
        monkeypatch.undo()
        assert (await tc.save_state("full")).step == 1


async def _train(tc, bad=None) -> list[float]:
    """Two SFT steps, ``bad()`` (a refused load_state) sent between them with the second step queued behind it;
    then the log-probs the weights give."""
    d = sft_datum([5, 6, 7, 8, 9])
    await tc.forward_backward([d], "cross_entropy")
    await tc.optim_step(AdamParams(learning_rate=1e-2))
    if bad is not None:
        refused = bad()
        fb, opt = tc.forward_backward([d], "cross_entropy"), tc.optim_step(AdamParams(learning_rate=1e-2))  # numbered after it
        with pytest.raises(InvalidInputError) as err:
            await refused
        assert err.value.field == "path" and err.value.void, err.value
        await fb
        assert (await opt).step == 2
    else:
        await tc.forward_backward([d], "cross_entropy")
        await tc.optim_step(AdamParams(learning_rate=1e-2))
    out = await tc.forward([d], "cross_entropy")
    return list(out.loss_fn_outputs[0]["logprobs"].data)


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["unknown", "another tenant's"])
async def test_a_load_state_the_worker_refuses_voids_its_seq_and_the_client_goes_on(worker, tiny, path):
    """Over http:// the client cannot judge a load path before numbering; the worker refused it after, leaving the seq
    free, so the client's later ops waited for it and every one was a PoisonedError. Now the refusal uses up the
    seq (``void``) and the ops after it run: the weights are those of a run that never sent it."""
    import asyncsess

    async with asyncsess.ServiceClient(worker.url, api_key=OTHER) as theirs:
        other = await theirs.create_lora_training_client(tiny, rank=2, seed=0)
        their_state = (await other.save_state("theirs")).path
    async with asyncsess.ServiceClient(worker.url, api_key=KEY) as svc:
        tc = await svc.create_lora_training_client(tiny, rank=2, seed=0)
        mine = (await tc.save_state("mine")).path
        bad_path = {"unknown": mine + "-missing", "another tenant's": their_state}[path]
        refused = await _train(tc, lambda: tc.load_state(bad_path))
        assert tc.current_sequence_number == 7  # save, a step (2 ops), the refused load, a step, forward
        clean = await _train(await svc.create_lora_training_client(tiny, rank=2, seed=0))
    assert refused == clean
