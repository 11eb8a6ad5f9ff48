"""What the official ``tinker`` SDK (0.38) gets for bad input a stranger sends through it: a 4xx it raises
readably, and nothing else changes — the refused request's ``seq_id`` is used up, so the model's next request
runs, and nothing is saved or created."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import tinker
from tinker import types

from .conftest import API_KEY, Server, start_server

pytestmark = pytest.mark.tinker

BASE = "mock/bigram-tiny"
GAP = 2.0  # seconds a model's queue waits for a missing seq_id before failing the requests behind it


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    for srv in start_server("mock://"):
        srv.door.gap_timeout = GAP  # a request left waiting on a seq_id the server never used up fails fast
        srv.door.skip_gaps = False  # ... rather than run once the gap is skipped: these tests check every turn is used
        yield srv


@pytest.fixture(scope="module")
def service(server: Server) -> Iterator[tinker.ServiceClient]:
    sc = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    yield sc
    sc.holder.close()


def _datum(weights: list[float], **inputs: list[float]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": weights, **inputs},
    )


GOOD = [_datum([1.0, 1.0, 1.0])]
IS_INPUTS = {"logprobs": [-1.0, -1.0, -1.0], "advantages": [1.0, 1.0, 1.0]}

Refusal = Callable[[tinker.TrainingClient], Any]
REFUSALS: dict[str, tuple[Refusal, type[Exception], str]] = {
    "NaN weight": (lambda tc: tc.forward_backward([_datum([1.0, math.nan, 1.0])], "cross_entropy"), tinker.BadRequestError, "weights"),
    "infinite logprob": (
        lambda tc: tc.forward_backward(
            [_datum([1.0, 1.0, 1.0], logprobs=[-1.0, -math.inf, -1.0], advantages=[1.0, 1.0, 1.0])], "importance_sampling"
        ),
        tinker.BadRequestError,
        "logprobs",
    ),
    "positive sampling logprob": (
        lambda tc: tc.forward_backward([_datum([1.0] * 3, logprobs=[-1.0, 50.0, -1.0], advantages=[1.0] * 3)], "importance_sampling"),
        tinker.BadRequestError,
        "logprobs",
    ),
    "sampling logprob of -1e30": (
        lambda tc: tc.forward_backward([_datum([1.0] * 3, logprobs=[-1.0, -1e30, -1.0], advantages=[1.0] * 3)], "ppo"),
        tinker.BadRequestError,
        "logprobs",
    ),
    "weight of -1e30 (AdamW's g² overflowed: every later step of the weights was 0)": (
        lambda tc: tc.forward_backward([_datum([-1e30, 1.0, 1.0])], "cross_entropy"),
        tinker.BadRequestError,
        "weights",
    ),
    "advantage of 1e30": (
        lambda tc: tc.forward_backward([_datum([1.0] * 3, logprobs=[-1.0] * 3, advantages=[1.0, 1e30, 1.0])], "ppo"),
        tinker.BadRequestError,
        "advantages",
    ),
    "forward of a NaN advantage": (
        lambda tc: tc.forward([_datum([1.0, 1.0, 1.0], logprobs=[-1.0] * 3, advantages=[math.nan] * 3)], "importance_sampling"),
        tinker.BadRequestError,
        "advantages",
    ),
    "save_state name with ..": (lambda tc: tc.save_state("../escape"), tinker.BadRequestError, "checkpoint name"),
    "save_weights_for_sampler name with /": (lambda tc: tc.save_weights_for_sampler("a/b"), tinker.BadRequestError, "checkpoint name"),
    "save_state name '.' (on local:// the directory itself; mock:// took it)": (
        lambda tc: tc.save_state("."),
        tinker.BadRequestError,
        "checkpoint name",
    ),
    "save_weights_for_sampler name '-x'": (lambda tc: tc.save_weights_for_sampler("-x"), tinker.BadRequestError, "checkpoint name"),
    "save_state with a TTL of 0": (lambda tc: tc.save_state("x", ttl_seconds=0), tinker.BadRequestError, "ttl_seconds"),
    "save_weights_for_sampler with a TTL of 10**30": (
        lambda tc: tc.save_weights_for_sampler("x", ttl_seconds=10**30),
        tinker.BadRequestError,
        "ttl_seconds",
    ),
    # the SDK's kind="inflight" (later saves update its weights) was served as a snapshot, as if kind were not sent
    "an inflight sampling client": (lambda tc: tc.save_weights_and_get_sampling_client(kind="inflight"), tinker.BadRequestError, "kind"),
    # the cookbook's AsyncConfig default: the 400 says why (not public) and what to use instead
    "Tinker's stable_reinforce": (
        lambda tc: tc.forward_backward([_datum([1.0] * 3, **IS_INPUTS)], "stable_reinforce"),
        tinker.BadRequestError,
        "stable_reinforce is not offered.*ppo",
    ),
    "load_state of a path never saved": (lambda tc: tc.load_state("tinker://nobody:train:0/weights/x"), tinker.NotFoundError, "path"),
    # a backend path (not tinker://) goes to the backend as is: one that holds nothing was accepted, failed when run,
    # and failed every later op of the model; the backend's own precheck now refuses it before its turn (a 404, as a
    # tinker:// path never saved: a gone path the door no longer remembers reaches the backend and must read the same)
    "load_state of a backend path that holds nothing": (
        lambda tc: tc.load_state("mock://nowhere/weights/x"),
        tinker.NotFoundError,
        "no checkpoint",
    ),
    # mock:// reports a 512-token context: such a datum failed when run, and every later op of the model with it
    "a datum past the model's context": (
        lambda tc: tc.forward_backward(
            [
                types.Datum(
                    model_input=types.ModelInput.from_ints([5] * 600), loss_fn_inputs={"target_tokens": [5] * 600, "weights": [1.0] * 600}
                )
            ],
            "cross_entropy",
        ),
        tinker.BadRequestError,
        "context of 512",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refused_op_uses_up_its_seq_id(service: tinker.ServiceClient, server: Server, case: str) -> None:
    """The SDK numbers every op; a refusal the server did not count as that op's turn left the model's queue
    waiting for it, so every later op failed ('ops N..N never arrived')."""
    call, error, match = REFUSALS[case]
    tc = service.create_lora_training_client(base_model=BASE, rank=8).result()
    tc.forward_backward(GOOD, "cross_entropy").result()
    with pytest.raises(error, match=match):
        call(tc).result()
    out = tc.forward_backward(GOOD, "cross_entropy").result()  # waited GAP s, then failed, before the fix
    assert out.metrics["loss:sum"] > 0
    assert tc.optim_step(types.AdamParams(learning_rate=0.1)).result() is not None
    assert [
        c.checkpoint_id for c in tinker.RestClient(base_url=server.url, api_key=API_KEY).list_checkpoints(tc.model_id).result().checkpoints
    ] == []


def test_load_state_of_sampler_weights_uses_up_its_seq_id(service: tinker.ServiceClient) -> None:
    tc = service.create_lora_training_client(base_model=BASE, rank=8).result()
    sampler_path = tc.save_weights_for_sampler("for-sampling").result().path
    before = tc.forward(GOOD, "cross_entropy").result().metrics["loss:sum"]
    with pytest.raises(tinker.BadRequestError, match="holds sampler weights"):
        tc.load_state(sampler_path).result()
    assert tc.forward(GOOD, "cross_entropy").result().metrics["loss:sum"] == before  # runs, on unchanged weights


OTHER_KEY = "tml-asyncsess-other"


@pytest.fixture(scope="module")
def shared() -> Iterator[Server]:
    """One server, two tenants."""
    yield from start_server("mock://", api_keys={API_KEY, OTHER_KEY})


def test_another_keys_backend_path_is_not_found(shared: Server) -> None:
    """A path that is not ``tinker://`` goes to the backend as is; mock:// names its sessions mock-train-1, 2, ...,
    so another key could resume (and read) a tenant's training state by spelling its backend path."""
    owner = tinker.ServiceClient(base_url=shared.url, api_key=API_KEY)
    other = tinker.ServiceClient(base_url=shared.url, api_key=OTHER_KEY)
    try:
        tc = owner.create_lora_training_client(base_model=BASE, rank=8).result()
        tc.forward_backward(GOOD, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.5)).result()
        state = shared.door.checkpoints[tc.save_state("mine").result().path].backend_path
        backend_id = shared.door.models[tc.model_id].backend_id
        assert state == f"mock://{backend_id}/weights/mine"  # what a stranger can guess
        for spelled in (state, f"mock://{backend_id}/weights/../weights/mine"):
            with pytest.raises(tinker.NotFoundError, match="path"):
                other.create_training_client_from_state_with_optimizer(spelled).result()
        theirs = other.create_lora_training_client(base_model=BASE, rank=8).result()
        before = theirs.forward(GOOD, "cross_entropy").result().metrics["loss:sum"]
        with pytest.raises(tinker.NotFoundError, match="path"):
            theirs.load_state(state).result()
        assert theirs.forward(GOOD, "cross_entropy").result().metrics["loss:sum"] == before  # nothing loaded
        mine = owner.create_training_client_from_state_with_optimizer(state).result()  # the owner still may
        assert mine.forward(GOOD, "cross_entropy").result().metrics == tc.forward(GOOD, "cross_entropy").result().metrics
    finally:
        owner.holder.close()
        other.holder.close()


def test_a_target_wider_than_1024_per_position_is_a_400(service: tinker.ServiceClient, server: Server) -> None:
    """A [1, K] target with K past 1,024 was taken, read cell by cell on the door's event loop (a [1, 6_000_000]
    one held every other key for 7 s) and sampled; now a 400 naming the field, before the cells are read."""
    sampler = service.create_sampling_client(base_model=BASE).result()
    body = {"sampling_session_id": sampler._sampling_session_id, "num_samples": 1, "sampling_params": {"max_tokens": 1}}
    body |= {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]}, "seq_id": 960}
    wide = {"data": [7] * 1025, "dtype": "int64", "shape": [1, 1025]}
    resp = httpx.post(f"{server.url}/api/v1/asample", json=body | {"target_prompt_logprobs": wide}, headers={"X-API-Key": API_KEY})
    assert resp.status_code == 400 and resp.json()["field"] == "target_prompt_logprobs", resp.text


def test_a_prompt_longer_than_the_context_is_a_400_before_it_is_read(service: tinker.ServiceClient, server: Server) -> None:
    """A prompt past the model's context was taken, hashed and checked token by token on the door's event loop (40M
    tokens held every other key for 6 s) and then failed when run; now a 400 naming ``prompt`` counted from the list
    lengths. A prompt that fits but leaves no room still fails when run (see test_official_sdk)."""
    sampler = service.create_sampling_client(base_model=BASE).result()
    params = types.SamplingParams(max_tokens=1)
    with pytest.raises(tinker.BadRequestError, match="prompt"):
        sampler.sample(types.ModelInput.from_ints([5] * 513), 1, params).result()  # mock://'s context is 512
    body = {"sampling_session_id": sampler._sampling_session_id, "seq_id": 970, "num_samples": 1, "sampling_params": {"max_tokens": 1}}
    chunks = [{"type": "encoded_text", "tokens": []}] * 513 + [{"type": "encoded_text", "tokens": [5]}]
    resp = httpx.post(f"{server.url}/api/v1/asample", json=body | {"prompt": {"chunks": chunks}}, headers={"X-API-Key": API_KEY})
    assert resp.status_code == 400 and resp.json()["field"] == "prompt", resp.text
    assert sampler.sample(types.ModelInput.from_ints([5] * 500), 1, params).result().sequences


def test_targets_on_a_one_token_prompt_are_a_400_naming_the_field(service: tinker.ServiceClient) -> None:
    """A one-token prompt has no position to score; its ``[0, K]`` targets (which the SDK lets through) crashed
    mock:// with ValueError in the door's sample (an internal error); now a 400 naming the field, as last_n is."""
    sampler = service.create_sampling_client(base_model=BASE)
    params, none = types.SamplingParams(max_tokens=1, seed=0), types.TensorData(data=[], dtype="int64", shape=[0, 2])
    with pytest.raises(tinker.BadRequestError, match="target_prompt_logprobs"):
        sampler.sample(types.ModelInput.from_ints([5]), 1, params, target_prompt_logprobs=none).result()
    assert sampler.sample(types.ModelInput.from_ints([5]), 1, params).result().sequences


def test_a_target_id_past_int64_is_refused(service: tinker.ServiceClient, server: Server) -> None:
    """Sent raw (the SDK's TensorData cannot hold it), a target id of 2**63 or 10**30 was accepted and the sample
    failed when run with ``OverflowError`` (category ``unknown``); now a 400 naming the field."""
    sampler = service.create_sampling_client(base_model=BASE).result()
    body = {"sampling_session_id": sampler._sampling_session_id, "num_samples": 1, "sampling_params": {"max_tokens": 1}}
    body |= {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]}}
    for seq, bad in enumerate((2**63, 10**30)):
        target = {"data": [bad], "dtype": "int64", "shape": [1, 1]}
        sent = body | {"seq_id": 950 + seq, "target_prompt_logprobs": target}
        resp = httpx.post(f"{server.url}/api/v1/asample", json=sent, headers={"X-API-Key": API_KEY})
        assert resp.status_code == 400 and resp.json()["field"] == "target_prompt_logprobs", resp.text


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"rank": 4096}, "lora_config.rank"),
        ({"rank": 2**40}, "lora_config.rank"),
        ({"seed": 2**63}, "lora_config.seed"),
        ({"seed": -1}, "lora_config.seed"),
    ],
)
def test_create_model_refuses_a_rank_or_seed_out_of_range(
    service: tinker.ServiceClient, server: Server, options: dict[str, int], match: str
) -> None:
    """The door handed any rank and seed to the backend (mock:// took rank 2**40; local:// would try to allocate
    it). asyncsess's own client refuses both before sending; now the door does too, creating nothing."""
    models = len(server.door.models)
    with pytest.raises(tinker.BadRequestError, match=match):
        service.create_lora_training_client(base_model=BASE, **{"rank": 8, **options}).result()
    assert len(server.door.models) == models


def test_checkpoint_ttl_out_of_range_is_refused(service: tinker.ServiceClient, server: Server) -> None:
    """A TTL of 10**30 s was stored, and every listing of the run's checkpoints was then a 500 (no such date)."""
    rest = tinker.RestClient(base_url=server.url, api_key=API_KEY)
    tc = service.create_lora_training_client(base_model=BASE, rank=8).result()
    path = tc.save_state("kept").result().path
    for ttl in (10**30, 2**63, 0):
        with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
            rest.set_checkpoint_ttl_from_tinker_path(path, ttl).result()
    [ck] = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert ck.expires_at is None
    rest.set_checkpoint_ttl_from_tinker_path(path, 86400).result()
    [ck] = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert ck.expires_at is not None and ck.expires_at > ck.time


def test_a_save_with_ttl_seconds_is_listed_with_its_expiry_and_is_gone_once_it_passes(
    service: tinker.ServiceClient, server: Server
) -> None:
    """save_state / save_weights_for_sampler dropped ttl_seconds: the checkpoint was listed with expires_at None
    and never expired (only PUT .../ttl set one, and nothing enforced it)."""
    rest = tinker.RestClient(base_url=server.url, api_key=API_KEY)
    tc = service.create_lora_training_client(base_model=BASE, rank=8).result()
    state = tc.save_state("for-an-hour", ttl_seconds=3600).result().path
    sampler = tc.save_weights_for_sampler("for-two-hours", ttl_seconds=7200).result().path
    kept = tc.save_state("kept").result().path
    listed = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed[kept].expires_at is None
    for path, ttl in ((state, 3600), (sampler, 7200)):
        expires_at = listed[path].expires_at
        assert expires_at is not None and abs((expires_at - listed[path].time).total_seconds() - ttl) <= 1
    for path in (state, sampler):  # their time passes
        server.door.checkpoints[path].expires_at = time.time() - 1
    assert [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [kept]
    assert rest.get_training_run(tc.model_id).result().last_sampler_checkpoint is None
    with pytest.raises(tinker.NotFoundError, match="path"):
        tc.load_state(state).result()
    with pytest.raises(tinker.NotFoundError):
        sc = service.create_sampling_client(model_path=sampler).result()
        sc.sample(types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2)).result()
    tc.load_state(kept).result()  # the queue goes on


def test_an_expired_checkpoint_is_deleted_on_the_backend_and_its_backend_path_is_not_found(
    service: tinker.ServiceClient, server: Server
) -> None:
    """Past its TTL a checkpoint was only forgotten by the door: its owner still loaded and sampled it by its
    backend path (``mock://mock-train-1/weights/<name>``, which passes through to the backend), and the backend
    kept it. Now expiry deletes the backend copy, as a REST delete does, and the path is a 404 as a never-issued one."""
    rest = tinker.RestClient(base_url=server.url, api_key=API_KEY)
    tc = service.create_lora_training_client(base_model=BASE, rank=8).result()
    backend_id = server.door.models[tc.model_id].backend_id
    state = tc.save_state("short", ttl_seconds=3600).result().path
    sampler = tc.save_weights_for_sampler("short", ttl_seconds=3600).result().path
    raw_state, raw_sampler = (server.door.checkpoints[p].backend_path for p in (state, sampler))

    def on_backend() -> list[str]:
        return sorted(c.checkpoint_id for c in asyncio.run(server.backend.list_checkpoints(backend_id)))

    assert on_backend() == ["sampler_weights/short", "weights/short"]
    for path in (state, sampler):  # their time passes
        server.door.checkpoints[path].expires_at = time.time() - 1
    assert rest.list_checkpoints(tc.model_id).result().checkpoints == []
    with pytest.raises(tinker.NotFoundError, match="path"):
        service.create_training_client_from_state(raw_state).result()
    with pytest.raises(tinker.NotFoundError, match="path"):
        tc.load_state(raw_state).result()
    session = {"session_id": tc.model_id.split(":")[0], "sampling_session_seq_id": 900}  # the SDK sends only tinker:// here
    resp = httpx.post(
        f"{server.url}/api/v1/create_sampling_session", json=session | {"model_path": raw_sampler}, headers={"X-API-Key": API_KEY}
    )
    assert resp.status_code == 404 and resp.json()["field"] == "model_path", resp.text
    assert on_backend() == []
    assert tc.save_state("short").result().path == state  # the name is free again, and its new backend copy loads
    resumed = service.create_training_client_from_state(raw_state).result()
    assert resumed.forward(GOOD, "cross_entropy").result().metrics == tc.forward(GOOD, "cross_entropy").result().metrics


def test_a_checkpoint_saved_twice_under_one_name_is_listed_once_and_deleted_once(service: tinker.ServiceClient, server: Server) -> None:
    """A second save under a used name failed on the backend (its name taken, overwrite not passed on), which
    failed every later op of the model, overwrite=True included. Now the name is refused at once (400) unless
    overwrite, and a replaced checkpoint is listed, and deleted, once."""
    rest = tinker.RestClient(base_url=server.url, api_key=API_KEY)
    tc = service.create_lora_training_client(base_model=BASE, rank=8).result()
    path = tc.save_state("same").result().path
    with pytest.raises(tinker.BadRequestError, match="overwrite"):  # not a 409: the SDK retries those
        tc.save_state("same").result()
    sampler = tc.save_weights_for_sampler("same").result().path
    with pytest.raises(tinker.BadRequestError, match="already saved"):
        tc.save_weights_for_sampler("same").result()
    tc.forward_backward(GOOD, "cross_entropy").result()  # the queue goes on
    assert tc.save_state("same", overwrite=True).result().path == path
    assert sorted(c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints) == sorted([path, sampler])
    rest.delete_checkpoint_from_tinker_path(path).result()
    run = rest.get_training_run(tc.model_id).result()
    assert run.last_checkpoint is None and run.last_sampler_checkpoint is not None
    assert run.last_sampler_checkpoint.tinker_path == sampler
    assert tc.save_state("same").result().path == path  # the name is free again


def test_a_step_on_a_non_finite_gradient_is_refused_and_the_model_goes_on(service: tinker.ServiceClient, server: Server) -> None:
    """A sampling log-prob of -1e30 overflowed the importance ratio: the gradient was NaN, optim_step applied it
    and the weights were NaN for good. The log-prob is now refused (REFUSALS); a non-finite gradient that gets
    through anyway is not applied: the step fails readably and the model's next requests run."""
    tc = service.create_lora_training_client(base_model=BASE, rank=8).result()
    tc.forward_backward(GOOD, "cross_entropy").result()
    backend_id = server.door.models[tc.model_id].backend_id
    server.backend.trainer(backend_id).grad[5, 6] = math.nan  # type: ignore[attr-defined]
    with pytest.raises(tinker.RequestFailedError, match="NonFiniteGradientError.*not applied") as err:
        tc.optim_step(types.AdamParams(learning_rate=0.1)).result(timeout=120)
    assert err.value.category == "user"  # a StrEnum
    assert tc.forward_backward(GOOD, "cross_entropy").result().metrics["loss:sum"] > 0
    step = tc.optim_step(types.AdamParams(learning_rate=0.1)).result(timeout=120)
    assert math.isfinite(step.metrics["grad_norm"]) and step.metrics["grad_norm"] > 0


def test_a_sample_of_too_many_sequences_is_refused(service: tinker.ServiceClient) -> None:
    """num_samples had no upper bound: 10**6 samples ran on the server (mock:// on its event loop, which froze
    every tenant's requests) and built one huge answer. The door now refuses what asyncsess's client refuses."""
    tc = service.create_lora_training_client(base_model=BASE, rank=8).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt, params = types.ModelInput.from_ints([5, 6]), types.SamplingParams(max_tokens=1, seed=0)
    with pytest.raises(tinker.BadRequestError, match="num_samples"):
        sampler.sample(prompt, num_samples=1001, sampling_params=params).result()
    assert len(sampler.sample(prompt, num_samples=1000, sampling_params=params).result().sequences) == 1000


def test_a_bad_prompt_logprobs_last_n_is_refused(service: tinker.ServiceClient, server: Server) -> None:
    """The SDK checks it itself; sent raw, "x" was accepted and failed the sample later with a ValueError."""
    tc = service.create_lora_training_client(base_model=BASE, rank=8).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    body = {"sampling_session_id": sampler._sampling_session_id, "seq_id": 900, "num_samples": 1, "prompt_logprobs": True}
    body |= {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]}, "sampling_params": {"max_tokens": 1}}
    for last_n in ("x", 0, -5, 2.5):
        resp = httpx.post(f"{server.url}/api/v1/asample", json=body | {"prompt_logprobs_last_n": last_n}, headers={"X-API-Key": API_KEY})
        assert resp.status_code == 400 and resp.json()["field"] == "prompt_logprobs_last_n", resp.text


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"topk_prompt_logprobs": 1025}, "topk_prompt_logprobs"),
        ({"topk_sample_logprobs": -1}, "topk_sample_logprobs"),
        ({"prompt_alt_tokens_k": 2}, "prompt_alt_tokens_k"),
        ({"prompt_logprobs_last_n": 2, "include_prompt_logprobs": True}, "prompt_logprobs_last_n"),  # the prompt has 2 tokens
        ({"target_prompt_logprobs": types.TensorData(data=[7, 8], dtype="int64", shape=[2, 1])}, "target_prompt_logprobs"),
        ({"target_prompt_logprobs": types.TensorData(data=[-2], dtype="int64", shape=[1, 1])}, "target_prompt_logprobs"),
    ],
)
def test_bad_log_prob_options_of_a_sample_are_refused(service: tinker.ServiceClient, options: dict[str, Any], match: str) -> None:
    """Top-k widths past asyncsess's bound, a last_n past the prompt and a target of the wrong shape are 400s
    naming the field (last_n of any size was accepted before); prompt alternatives are not offered."""
    sampler = service.create_sampling_client(base_model=BASE)
    prompt, params = types.ModelInput.from_ints([5, 6]), types.SamplingParams(max_tokens=1, seed=0)
    with pytest.raises(tinker.BadRequestError, match=match):
        sampler.sample(prompt, 1, params, **options).result()
    assert len(sampler.sample(prompt, 1, params, topk_prompt_logprobs=1).result().topk_prompt_logprobs) == 2


@pytest.mark.parametrize("listing", ["list_sessions", "list_training_runs", "list_user_checkpoints"])
@pytest.mark.parametrize(("page", "field"), [({"limit": -1}, "limit"), ({"limit": 0}, "limit"), ({"offset": -1}, "offset")])
def test_a_listing_page_out_of_range_is_refused_naming_the_field(
    service: tinker.ServiceClient, server: Server, listing: str, page: dict[str, int], field: str
) -> None:
    """list_sessions and list_training_runs sliced their rows with any limit and offset: offset=-1 listed the last
    row, limit=-1 all but the last. Now every paged listing takes what list_user_checkpoints took (limit 1..10000,
    offset >= 0) and the 400 names the field that is out of range (offset was reported as limit)."""
    service.create_lora_training_client(base_model=BASE, rank=8).result()  # a session and a run to list
    rest = tinker.RestClient(base_url=server.url, api_key=API_KEY)
    with pytest.raises(tinker.BadRequestError) as err:
        getattr(rest, listing)(**page).result()
    assert err.value.body["field"] == field  # type: ignore[index]
    assert getattr(rest, listing)(limit=10_000, offset=0).result() is not None


def test_record_stability_info_is_refused_not_ignored(service: tinker.ServiceClient, server: Server) -> None:
    """A sampler made with record_stability_info=True sampled as if it had not been asked: the loop went on to
    stable_reinforce believing its sequences were recorded. Now its samples are a 400 naming the field (the SDK
    sends the flag only with each sample), and plain samples carry sequence ids the SDK's provenance takes."""
    tc = service.create_lora_training_client(base_model=BASE, rank=8).result()
    prompt, params = types.ModelInput.from_ints([5, 6]), types.SamplingParams(max_tokens=2, seed=0)
    for recording in (
        tc.save_weights_and_get_sampling_client(record_stability_info=True).result(),
        service.create_sampling_client(base_model=BASE, record_stability_info=True).result(),
    ):
        with pytest.raises(tinker.BadRequestError, match="record_stability_info.*stable_reinforce") as err:
            recording.sample(prompt, 2, params).result()
        assert err.value.body["field"] == "record_stability_info"  # type: ignore[index]
    plain = tc.save_weights_and_get_sampling_client().result()
    sequences = plain.sample(prompt, 3, params).result().sequences + plain.sample(prompt, 1, params).result().sequences
    ids = [s.sequence_id for s in sequences]
    assert all(isinstance(i, str) and i for i in ids) and len(set(ids)) == 4
    assert [types.SampledProvenanceSpan(sequence_id=i, length=2).sequence_id for i in ids] == ids  # non-empty, as the SDK checks


def test_an_optimizer_other_than_adamw_is_refused_when_the_model_is_made(service: tinker.ServiceClient, server: Server) -> None:
    """create_lora_training_client(optimizer=DimuonOptimizerConfig()) made a model that trained with AdamW, silently."""
    models = len(server.door.models)
    with pytest.raises(tinker.BadRequestError, match="optimizer_config"):
        service.create_lora_training_client(base_model=BASE, rank=8, optimizer=types.DimuonOptimizerConfig()).result()
    assert len(server.door.models) == models
    tc = service.create_lora_training_client(base_model=BASE, rank=8, optimizer=types.AdamOptimizerConfig()).result()
    assert tc.optim_step(types.AdamParams(learning_rate=0.1)).result() is not None
