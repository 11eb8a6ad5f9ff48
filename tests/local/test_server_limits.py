"""The worker's validation layer, class by class (issue 11): every rejection is a 400 naming the field and
the fix, nothing is created by a refused request, and the server stays healthy.

Each case is a class of input from the issue (bad checkpoint paths, filesystem paths as base models,
non-finite or overflowing numbers, uncapped counts, bad names, empty stops), tried on every route that
takes it. The fuzz (test_server_fuzz.py) covers the same classes by generation.
"""

from __future__ import annotations

import http.client
import threading
import uuid

import httpx
import pytest

torch = pytest.importorskip("torch")

from .server_helpers import KEY, MINE, assert_healthy, assert_openai_refused, assert_refused, new_sampler, new_session, send, start_worker  # noqa: E402

pytestmark = pytest.mark.local

NAN, INF = float("nan"), float("inf")
BAD_PATHS = [
    "a\x00b",
    "local://x\x00",
    "\ud800",
    "x" * 5000,
    "",
    "/",
    "/proc/self",
    "local:///etc",
    "../../etc/passwd",
    "s3://b/k",
    "local://\n",
]
BAD_MODELS = ["/", "/proc/self", "", "..", "/etc", "\ud800", "a\x00", "x" * 5000, "local:///etc", "tiny-llama-nope"]
BAD_NAMES = ["x\n", "\n", "..", "a..b", "a/b", "", ".hidden", "x" * 129, "a\x00", "é", "\ud800", " x"]


@pytest.fixture(scope="module")
def worker(tiny, tmp_path_factory):
    w = start_worker(tiny, str(tmp_path_factory.mktemp("limits-ckpt")))
    yield w
    w.stop()


@pytest.fixture(scope="module")
def ids(c, tiny):
    """A session with a saved checkpoint, and a sampler on the base model (both of KEY)."""
    sid = new_session(c, tiny, MINE)
    r = c.post(f"/v1/sessions/{sid}/ops", json={"kind": "save_state", "seq": 1, "idempotency_key": "s1", "name": "kept"}, headers=MINE)
    assert r.status_code == 200, r.text
    return {"sid": sid, "smp": new_sampler(c, MINE, base_model=tiny), "state": r.json()["result"]["path"]}


def _op(worker, sid, **kw):
    """An op at the session's next seq (a refused op uses it up), under a fresh idempotency key."""
    return {"kind": "optim_step", "seq": worker.backend.next_seq(sid), "idempotency_key": uuid.uuid4().hex, **kw}


@pytest.mark.parametrize("path", BAD_PATHS)
def test_bad_checkpoint_paths_are_refused_on_every_route(c, worker, tiny, ids, path):
    assert_refused(send(c, "POST", "/v1/samplers", {"model_path": path}, MINE), "model_path")
    assert_refused(send(c, "POST", "/v1/sessions", {"base_model": tiny, "from_path": path}, MINE), "from_path")
    assert_refused(send(c, "POST", f"/v1/sessions/{ids['sid']}/ops", _op(worker, ids["sid"], kind="load_state", path=path), MINE), "path")


@pytest.mark.parametrize("name", BAD_MODELS)
def test_base_model_is_a_name_from_the_list_never_a_path(c, worker, tiny, name):
    assert_refused(send(c, "POST", "/v1/sessions", {"base_model": name}, MINE), "base_model")
    assert_refused(send(c, "POST", "/v1/samplers", {"base_model": name}, MINE), "base_model")
    r = c.get("/v1/tokenizer", params={"base_model": name}, headers=MINE) if "\ud800" not in name else None
    if r is not None:
        assert_refused(r, "base_model")
    body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    unnamable = not name or "\ud800" in name  # no model has this name: a 400 (a lone surrogate is not text)
    assert_openai_refused(send(c, "POST", "/v1/chat/completions", body, MINE), "model", status=400 if unnamable else 404)
    assert set(worker.backend.engine.slots) == {tiny}  # nothing else was loaded


def test_checkpoint_dirs_are_base_models_for_nobody(c, worker, tiny, ids):
    """A merged checkpoint is a full model directory: naming it as a base model is refused, even by its owner."""
    r = c.post(
        f"/v1/sessions/{ids['sid']}/ops",
        json=_op(worker, ids["sid"], kind="save_weights", merge_weights=True),
        headers=MINE,
    )
    assert r.status_code == 200, r.text
    merged = r.json()["result"]["path"]
    for name in (merged, merged.removeprefix("local://")):
        assert_refused(send(c, "POST", "/v1/sessions", {"base_model": name}, MINE), "base_model")
        assert_refused(send(c, "POST", "/v1/samplers", {"base_model": name}, MINE), "base_model")
        assert_refused(c.get("/v1/tokenizer", params={"base_model": name}, headers=MINE), "base_model")
    assert new_sampler(c, MINE, model_path=merged)  # as a checkpoint path, its owner may sample it


@pytest.mark.parametrize("name", BAD_NAMES)
def test_checkpoint_names_match_the_whole_pattern(c, worker, ids, name):
    for kind in ("save_state", "save_weights"):
        r = send(c, "POST", f"/v1/sessions/{ids['sid']}/ops", _op(worker, ids["sid"], kind=kind, name=name), MINE)
        assert_refused(r, "name")
    root = worker.backend.engine.store.root
    assert not [p for p in root.rglob("*") if "\n" in p.name or p.name.startswith(".x")]


SESSION_CASES = [
    # session_options took any JSON: lone surrogates, NUL, and megabytes kept per session and echoed back
    ({"session_options": {"x": "\ud800"}}, "session_options"),
    ({"session_options": {"x": {"a\x00": 1}}}, "session_options"),
    ({"session_options": {"x": "y" * 20_000}}, "session_options"),
    ({"session_options": {"x": list(range(20_000))}}, "session_options"),
    ({"alpha": NAN}, "alpha"),
    ({"alpha": INF}, "alpha"),
    ({"alpha": -INF}, "alpha"),
    ({"alpha": 0}, "alpha"),
    ({"alpha": 1e300}, "alpha"),
    ({"rank": 0}, "rank"),
    ({"rank": 10**30}, "rank"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"seed": 10**40}, "seed"),
    ({"user_metadata": {"k": "\x00"}}, "user_metadata.k"),
    ({"user_metadata": {str(i): "v" for i in range(65)}}, "user_metadata"),
    ({"bogus": 1}, "bogus"),
    # a bool, a string or a float where an int or a bool goes (rank=true made a rank-1 session)
    ({"rank": True}, "rank"),
    ({"rank": 2.0}, "rank"),
    ({"seed": True}, "seed"),
    ({"alpha": True}, "alpha"),
    ({"train_mlp": "yes"}, "train_mlp"),
    ({"with_optimizer": 1}, "with_optimizer"),
]


@pytest.mark.parametrize(("extra", "field"), SESSION_CASES)
def test_session_numbers_are_finite_and_in_range(c, tiny, extra, field):
    assert_refused(send(c, "POST", "/v1/sessions", {"base_model": tiny, **extra}, MINE), field)


def test_a_new_session_answers_with_its_metadata_and_options(c, tiny):
    """As docs/compatibility.md says (and mock:// does): they were dropped from the answer."""
    options = {"training_session_name": "grpo-run-1", "s3_output_path": "s3://bucket/out"}
    body = {"base_model": tiny, "rank": 2, "user_metadata": {"run": "7"}, "session_options": options}
    info = c.post("/v1/sessions", json=body, headers=MINE).json()
    assert info["user_metadata"] == {"run": "7"} and info["session_options"] == options, info


OP_CASES = [
    ({"adam_params": {"learning_rate": INF}}, "adam_params.learning_rate"),
    ({"adam_params": {"learning_rate": NAN}}, "adam_params.learning_rate"),
    ({"adam_params": {"learning_rate": 1e30}}, "adam_params.learning_rate"),
    ({"adam_params": {"learning_rate": 1e39}}, "adam_params.learning_rate"),
    ({"adam_params": {"learning_rate": -1e-9}}, "adam_params.learning_rate"),
    ({"adam_params": {"eps": 0}}, "adam_params.eps"),
    ({"adam_params": {"eps": INF}}, "adam_params.eps"),
    ({"adam_params": {"eps": 1e-46}}, "adam_params.eps"),  # 0 in float32: the weights went NaN
    ({"adam_params": {"learning_rate": 3.0, "weight_decay": 1.0}}, "adam_params.weight_decay"),  # grew the weights to inf
    ({"adam_params": {"learning_rate": 0.01, "lora_plus_lr_ratio": 1000.0, "weight_decay": 0.5}}, "adam_params.lora_plus_lr_ratio"),
    ({"adam_params": {"weight_decay": NAN}}, "adam_params.weight_decay"),
    ({"adam_params": {"grad_clip_norm": INF}}, "adam_params.grad_clip_norm"),
    ({"adam_params": {"beta1": 1.0}}, "adam_params.beta1"),
    ({"seq": 0}, "seq"),
    ({"seq": -1}, "seq"),
    ({"seq": 2**70}, "seq"),
    ({"seq": 5000}, "seq"),  # too far ahead: refused at once, not held for the gap timeout
    ({"seq": True}, "seq"),  # was taken as seq 1 (and used it up)
    ({"seq": "1"}, "seq"),
    ({"adam_params": {"learning_rate": "0.001"}}, "adam_params.learning_rate"),  # was taken as 0.001
    ({"adam_params": {"learning_rate": 1e-3, "beta1": "0.9"}}, "adam_params.beta1"),
    ({"kind": "save_state", "ttl_seconds": True}, "ttl_seconds"),
    ({"idempotency_key": "\ud800"}, "idempotency_key"),
    (
        {
            "kind": "forward_backward",
            "loss_fn": "cross_entropy",
            "data": [{"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 3], "weights": [NAN, 1.0]}}],
        },
        "data[0].loss_fn_inputs['weights']",
    ),
    (
        {
            "kind": "forward_backward",
            "loss_fn": "cross_entropy",
            "data": [{"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 3], "weights": [1e39, 1.0]}}],
        },
        "data[0].loss_fn_inputs['weights']",
    ),
    (
        {
            "kind": "forward_backward",
            "loss_fn": "cross_entropy",
            "data": [{"model_input": [1, 2**70], "loss_fn_inputs": {"target_tokens": [2, 3], "weights": [1.0, 1.0]}}],
        },
        None,
    ),
    (
        {
            "kind": "forward_backward",
            "loss_fn": "ppo",
            "loss_fn_config": {"clip_low_threshold": NAN},
            "data": [{"model_input": [1], "loss_fn_inputs": {"target_tokens": [2], "logprobs": [-1.0], "advantages": [1.0]}}],
        },
        "loss_fn_config.clip_low_threshold",
    ),
    ({"kind": "forward_backward", "loss_fn": "cross_entropy", "data": [{"model_input": [1]}] * 1025}, "data"),
    *(  # a token id with a fraction, in text, or a bool was truncated or read as a number (6.5 trained on token 6)
        (
            {
                "kind": "forward_backward",
                "loss_fn": "cross_entropy",
                "data": [{"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": targets, "weights": weights}}],
            },
            "data[0]",
        )
        for targets, weights in (
            ([2.5, 3], [1.0, 1.0]),
            ({"data": [2.5, 3.0], "dtype": "float32", "shape": [2]}, [1.0, 1.0]),
            ({"data": [2.5, 3.0], "dtype": "int64"}, [1.0, 1.0]),
            (["2", "3"], [1.0, 1.0]),
            ([True, 3], [1.0, 1.0]),
            ([INF, 3], [1.0, 1.0]),
            ([2, 3], ["1.0", 1.0]),
            ([2, 3], {"data": [True, 1.0], "dtype": "float32"}),
        )
    ),
    *(  # sampler log-probs that are no log-probs: exp(p − q) overflowed and the step made the weights NaN
        (
            {
                "kind": "forward_backward",
                "loss_fn": loss_fn,
                "data": [
                    {"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 3], "logprobs": [-1.0, q], "advantages": [1.0, 1.0]}}
                ],
            },
            "data[0].loss_fn_inputs['logprobs']",
        )
        for loss_fn, q in (("importance_sampling", 50.0), ("ppo", -1e30))
    ),
]


@pytest.mark.parametrize(("extra", "field"), OP_CASES)
def test_op_numbers_are_finite_and_refused_before_anything_runs(c, worker, tiny, extra, field):
    sid = new_session(c, tiny, MINE)
    base = {"kind": "optim_step", "seq": 1, "idempotency_key": "k"} | ({} if "kind" in extra else {"adam_params": {}})
    err = assert_refused(send(c, "POST", f"/v1/sessions/{sid}/ops", base | extra, MINE), field)
    # a body that is no op leaves seq 1 free; an op refused after parsing uses it up ("void": true); neither poisons
    seq = 2 if err.get("void") else 1
    assert worker.backend.next_seq(sid) == seq, err
    r = c.post(
        f"/v1/sessions/{sid}/ops",
        json={"kind": "optim_step", "seq": seq, "idempotency_key": "ok", "adam_params": {"learning_rate": 10.0}},
        headers=MINE,
    )
    assert r.status_code == 200 and r.json()["result"]["step"] == 1, r.text


KIND_CASES = [
    ({"kind": "optim_step", "adam_params": {}, "data": []}, "data"),  # a field of another kind
    ({"kind": "optim_step", "path": "local:///x"}, "path"),
    ({"kind": "forward_backward", "loss_fn": "cross_entropy", "data": [], "adam_params": {}}, "adam_params"),
    ({"kind": "forward", "data": [], "merge_weights": True}, "merge_weights"),
    ({"kind": "save_state", "with_optimizer": False}, "with_optimizer"),
    ({"kind": "save_state", "merge_weights": True}, "merge_weights"),
    ({"kind": "load_state", "path": "x", "name": "n"}, "name"),
    ({"kind": "load_state"}, "path"),  # a field the kind needs
    ({"kind": "bogus"}, "kind"),
    ({"kind": None}, "kind"),
    ({"kind": "optim_step\x00"}, "kind"),
    ({}, "kind"),
]


@pytest.mark.parametrize(("extra", "field"), KIND_CASES)
def test_each_op_kind_takes_only_its_own_fields(c, tiny, extra, field):
    """The ops body is one schema per kind: a field the kind does not have (or lacks) is a 400 naming it,
    and the refused op takes no seq."""
    sid = new_session(c, tiny, MINE)
    assert_refused(send(c, "POST", f"/v1/sessions/{sid}/ops", {"seq": 1, "idempotency_key": "k", **extra}, MINE), field)
    r = c.post(f"/v1/sessions/{sid}/ops", json={"kind": "optim_step", "seq": 1, "idempotency_key": "ok"}, headers=MINE)
    assert r.status_code == 200 and r.json()["result"]["step"] == 1, r.text


SAMPLE_CASES = [
    # the body was strict, its nested sampling_params not: text and whole floats were taken as numbers
    ({"sampling_params": {"max_tokens": "2"}}, "sampling_params.max_tokens"),
    ({"sampling_params": {"max_tokens": 2.0}}, "sampling_params.max_tokens"),
    ({"sampling_params": {"max_tokens": 2, "temperature": "0.5"}}, "sampling_params.temperature"),
    ({"sampling_params": {"max_tokens": 2, "seed": 1.0}}, "sampling_params.seed"),
    ({"sampling_params": {"max_tokens": 2, "stop": [True]}}, "sampling_params.stop"),  # was token id 1
    ({"sampling_params": {"max_tokens": 2, "stop": [6.0]}}, "sampling_params.stop"),  # was token id 6
    ({"num_samples": 100000}, "num_samples"),
    ({"num_samples": 0}, "num_samples"),
    ({"num_samples": 2**70}, "num_samples"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [-1]}, "prompt[0]"),
    ({"prompt": [2**70]}, "prompt[0]"),
    ({"prompt": [1, 1000]}, "prompt"),  # outside the vocabulary (384)
    ({"sampling_params": {"temperature": NAN}}, "sampling_params.temperature"),
    ({"sampling_params": {"temperature": INF}}, "sampling_params.temperature"),
    ({"sampling_params": {"temperature": -1e-300}}, "sampling_params.temperature"),
    ({"sampling_params": {"top_p": NAN}}, "sampling_params.top_p"),
    ({"sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({"sampling_params": {"seed": -1}}, "sampling_params.seed"),
    ({"sampling_params": {"seed": 2**64}}, "sampling_params.seed"),
    ({"sampling_params": {"stop": ""}}, "sampling_params.stop"),
    ({"sampling_params": {"stop": ["ok", ""]}}, "sampling_params.stop"),
    ({"sampling_params": {"stop": ["x"] * 65}}, "sampling_params.stop"),
    ({"sampling_params": {"stop": [10**6]}}, "sampling_params.stop"),
    ({"sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens"),
    ({"sampling_params": {"max_tokens": 2**70}}, "sampling_params.max_tokens"),
    ({"sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
    ({"request_id": "a\x00"}, "request_id"),
    ({"prompt": [5, True]}, "prompt[1]"),  # was sampled as token 1
    ({"prompt": ["5"]}, "prompt[0]"),
    ({"num_samples": True}, "num_samples"),
    ({"topk_sample_logprobs": True}, "topk_sample_logprobs"),
    # [len(prompt) - 1][K] target ids: other shapes were a 500 (the gather or max() failed on the engine)
    ({"target_prompt_logprobs": []}, "target_prompt_logprobs"),
    ({"target_prompt_logprobs": [[7], [7]]}, "target_prompt_logprobs"),
    ({"target_prompt_logprobs": [[]]}, "target_prompt_logprobs"),
    ({"prompt": [5, 6, 7], "target_prompt_logprobs": [[7], [7, 8]]}, "target_prompt_logprobs"),
    ({"target_prompt_logprobs": [[-2]]}, "target_prompt_logprobs[0][0]"),
]


@pytest.mark.parametrize(("extra", "field"), SAMPLE_CASES)
def test_sampling_inputs_are_finite_and_capped(c, ids, extra, field):
    body = {"prompt": [5, 6], "num_samples": 1, "sampling_params": {"max_tokens": 2}, **extra}
    assert_refused(send(c, "POST", f"/v1/samplers/{ids['smp']}/sample", body, MINE), field)


def test_target_prompt_logprobs_of_the_right_shape_are_answered(c, ids):
    body = {"prompt": [5, 6, 7], "sampling_params": {"max_tokens": 1}, "target_prompt_logprobs": [[6, -1], [7, 6]]}
    r = c.post(f"/v1/samplers/{ids['smp']}/sample", json=body, headers=MINE)
    assert r.status_code == 200, r.text
    picked = r.json()["target_prompt_logprobs"]
    assert picked["shape"] == [2, 2] and picked["data"][1] == 0.0 and all(x < 0 for i, x in enumerate(picked["data"]) if i != 1)


def test_a_load_state_path_the_session_cannot_load_is_refused_before_anything_runs(c, worker, tiny, ids):
    """A save_weights path, or the state of a session with another LoRA rank, is refused by the worker's
    check before anything runs (it failed when applied, and failed the session): the refusal uses up its seq
    ("void": true), and the next op runs."""
    sid = new_session(c, tiny, MINE, rank=4)
    r = c.post(f"/v1/sessions/{sid}/ops", json={"kind": "save_weights", "seq": 1, "idempotency_key": "w", "name": "w"}, headers=MINE)
    assert r.status_code == 200, r.text
    for seq, path in enumerate((r.json()["result"]["path"], ids["state"]), 2):  # sampler weights; a rank-2 session's state
        err = assert_refused(send(c, "POST", f"/v1/sessions/{sid}/ops", _op(worker, sid, kind="load_state", path=path), MINE), "path")
        assert "sampler checkpoint" in err["message"] or "rank" in err["message"], err
        assert err["void"] is True and err["seq"] == seq, err
    weights = r.json()["result"]["path"]
    assert_refused(send(c, "POST", "/v1/sessions", {"base_model": tiny, "from_path": weights}, MINE), "from_path")  # was named 'path'
    r = c.post(f"/v1/sessions/{sid}/ops", json=_op(worker, sid, adam_params={"learning_rate": 1e-3}), headers=MINE)
    assert r.status_code == 200 and r.json()["result"]["step"] == 1, r.text


def test_a_state_of_another_lora_alpha_is_refused_before_anything_runs(c, worker, tiny, ids):
    """A rank-2 state loaded into a rank-2 session of another alpha was accepted: the same weights scaled by
    alpha / rank made another model (a forward's loss 27 where the saved session's was 6.4). It is refused, void."""
    r = c.post("/v1/sessions", json={"base_model": tiny, "rank": 2, "alpha": 100.0, "seed": 0}, headers=MINE)
    sid = r.json()["model_id"]
    err = assert_refused(send(c, "POST", f"/v1/sessions/{sid}/ops", _op(worker, sid, kind="load_state", path=ids["state"]), MINE), "path")
    assert "alpha 4" in err["message"] and "alpha 100" in err["message"] and err["void"] is True, err
    r = c.post(f"/v1/sessions/{sid}/ops", json=_op(worker, sid, adam_params={"learning_rate": 1e-3}), headers=MINE)
    assert r.status_code == 200 and r.json()["result"]["step"] == 1, r.text


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-30, 1e-5, 1e-4])
def test_tiny_temperatures_decode_greedily_without_nan(c, ids, temperature):
    body = {"prompt": [5, 6, 7], "num_samples": 3, "sampling_params": {"max_tokens": 4, "temperature": temperature, "stop": []}}
    r = c.post(f"/v1/samplers/{ids['smp']}/sample", json=body, headers=MINE)
    assert r.status_code == 200, r.text
    greedy = c.post(
        f"/v1/samplers/{ids['smp']}/sample", json={**body, "sampling_params": {**body["sampling_params"], "temperature": 0}}, headers=MINE
    )
    seqs = r.json()["sequences"]
    assert [s["tokens"] for s in seqs] == [greedy.json()["sequences"][0]["tokens"]] * 3
    assert all(lp == lp and abs(lp) < 1e30 for s in seqs for lp in s["logprobs"])


CHAT_CASES = [  # OpenAI's error shape: ``param`` names the field as a dotted path
    ({"stop": ""}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": [str(i) for i in range(17)]}, "stop"),
    ({"temperature": NAN}, "temperature"),
    ({"temperature": INF}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": True}, "temperature"),  # was sampled at temperature 1
    ({"temperature": "1"}, "temperature"),
    ({"top_p": True}, "top_p"),
    ({"seed": 2**64}, "seed"),
    ({"n": 0}, "n"),
    ({"n": 10**9}, "n"),
    ({"n": "2"}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**6}, "max_tokens"),
    ({"max_completion_tokens": 10**6}, "max_completion_tokens"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "a\x00"}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]}, "tools.0.function.description"),
    ({"messages": [{"role": "user", "content": "x" * 2_000_000}]}, "messages.0.content"),
]


@pytest.mark.parametrize(("extra", "field"), CHAT_CASES)
def test_chat_inputs_are_refused_with_the_field(c, tiny, extra, field):
    body = {"model": tiny, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    assert_openai_refused(send(c, "POST", "/v1/chat/completions", body, MINE), field)


def test_chat_tiny_temperature_and_stop_strings(c, tiny):
    body = {"model": tiny, "messages": [{"role": "user", "content": "what is 2 plus 3?"}], "max_tokens": 6}
    r = c.post("/v1/chat/completions", json={**body, "temperature": 1e-300, "stop": ["zzz"], "seed": 2**63 - 1}, headers=MINE)
    assert r.status_code == 200, r.text
    greedy = c.post("/v1/chat/completions", json={**body, "temperature": 0}, headers=MINE).json()
    assert r.json()["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]


@pytest.mark.parametrize("logprob_tokens", [[], [-1], [2**70], [1, 10**6], "abc", [5, True], ["5"]])
def test_logprobs_tokens_are_checked(c, ids, logprob_tokens):
    assert_refused(send(c, "POST", f"/v1/samplers/{ids['smp']}/logprobs", {"tokens": logprob_tokens}, MINE))


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": b"Bearer \xc3\xa9t\xc3\xa9"},  # non-ASCII (UTF-8)
        {"Authorization": b"Bearer \xff\xfe"},  # not UTF-8 at all
        {"X-API-Key": b"key-\xe9"},
        {"Authorization": "Bearer " + "k" * 10000},
        {"Authorization": "Basic " + KEY},
    ],
)
def test_every_route_and_the_docs_need_the_key(c, headers):
    for method, path in [
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
        ("GET", "/redoc"),
        ("GET", "/v1/models"),
        ("POST", "/v1/sessions"),
        ("GET", "/nope"),
    ]:
        r = c.request(method, path, headers=headers)
        assert_refused(r, "Authorization", status=401)


def test_docs_are_off_and_the_schema_is_behind_the_key(c):
    assert c.get("/openapi.json", headers=MINE).json()["paths"]["/v1/sessions/{session_id}/ops"]
    assert c.get("/docs", headers=MINE).status_code == 404 and c.get("/redoc", headers=MINE).status_code == 404
    assert_refused(c.put("/v1/models", headers=MINE), "method", status=405)


def test_an_unexpected_error_is_a_logged_500_and_the_connection_stays_open(worker, tiny, monkeypatch, caplog):
    async def broken():
        raise RuntimeError("injected fault")

    conn = http.client.HTTPConnection("127.0.0.1", worker.port, timeout=60)
    try:
        conn.request("GET", "/v1/models", headers=MINE)
        first = conn.getresponse()
        assert first.status == 200 and first.read()
        sock = conn.sock
        monkeypatch.setattr(worker.backend, "capabilities", broken)
        conn.request("GET", "/v1/capabilities", headers=MINE)
        r = conn.getresponse()
        body = r.read()
        assert r.status == 500 and b'"type":"ServerError"' in body and b"injected" not in body  # no internals leak
        assert (r.getheader("connection") or "").lower() != "close"
        monkeypatch.undo()
        conn.request("GET", "/v1/capabilities", headers=MINE)
        again = conn.getresponse()
        assert again.status == 200 and again.read()
        assert conn.sock is sock  # the same keep-alive connection
    finally:
        conn.close()
    assert any(
        "injected fault" in (rec.exc_text or "") or "injected" in rec.getMessage()
        for rec in caplog.records
        if rec.name == "asyncsess.worker"
    )


def test_a_body_over_the_cap_gets_a_413(tmp_path):
    from asyncsess_local.embedded import LocalBackend
    from asyncsess_local.server import serve_in_thread

    w = serve_in_thread(LocalBackend(device="cpu", checkpoint_dir=str(tmp_path)), [KEY], max_body_bytes=1000)
    try:
        with httpx.Client(base_url=w.url, timeout=60) as c:
            assert_refused(c.post("/v1/sessions", content=b"{" + b" " * 2000 + b"}", headers=MINE), "body", status=413)

            def chunks():
                for _ in range(20):
                    yield b" " * 100

            assert_refused(c.post("/v1/sessions", content=chunks(), headers=MINE), "body", status=413)  # no Content-Length
            assert c.get("/v1/models", headers=MINE).status_code == 200
    finally:
        w.stop()


def test_a_slow_loris_body_gets_a_408_and_frees_its_keys_slot(tmp_path):
    """A client that sent part of a body and then nothing held its connection and one of its key's in-flight
    requests for as long as it kept the socket open. The body now has ``max_body_seconds`` to arrive."""
    import json
    import socket

    from asyncsess_local.embedded import LocalBackend
    from asyncsess_local.server import serve_in_thread

    w = serve_in_thread(LocalBackend(device="cpu", checkpoint_dir=str(tmp_path)), [KEY], max_body_seconds=0.2, max_inflight_per_key=1)
    try:
        for path in ("/v1/sessions", "/v1/chat/completions"):
            with socket.create_connection(("127.0.0.1", w.port), timeout=30) as sock:  # (30 s: the fix answers in 0.2)
                head = f"POST {path} HTTP/1.1\r\nHost: w\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                sock.sendall(f'{head}Content-Length: 1000\r\n\r\n{{"model": '.encode())  # and the rest never comes
                reply = sock.makefile("rb")
                status = reply.readline()
                headers = dict(line.decode().strip().lower().split(": ", 1) for line in iter(reply.readline, b"\r\n"))
                body = reply.read(int(headers["content-length"]))
            assert b" 408 " in status and json.loads(body)["error"]["field"] == "body", (status, body)
        with httpx.Client(base_url=w.url, timeout=60) as c:  # the key's one in-flight slot is free again
            assert c.get("/v1/models", headers=MINE).status_code == 200
    finally:
        w.stop()


def test_a_save_the_disk_fails_is_a_void_507_and_leaves_nothing_under_its_name(c, worker, tiny, monkeypatch):
    """A save whose write failed for the disk (ENOSPC half-way through a file) was a 500 that poisoned the session
    (every later op a PoisonedError). It is a 507 ``InsufficientStorageError`` with a fix, void; the partial copy is
    removed, nothing is listed under the name, and the next ops run as if the save had never been sent."""
    import errno
    from pathlib import Path

    import safetensors.torch

    real = safetensors.torch.save_file

    def full_disk(tensors, filename, metadata=None):  # the adapter is written, the optimizer state half-way
        if str(filename).endswith("optimizer.safetensors"):
            Path(filename).write_bytes(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device", str(filename))
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    sid = new_session(c, tiny, MINE)
    ops = f"/v1/sessions/{sid}/ops"
    save = {"kind": "save_state", "seq": 1, "idempotency_key": "full-1", "name": "full"}
    err = assert_refused(c.post(ops, json=save, headers=MINE), status=507)
    assert err["type"] == "InsufficientStorageError" and err.get("void") is True and "ENOSPC" in err["message"], err
    assert "DELETE /v1/checkpoints" in err["fix"], err
    state = worker.backend.engine.store.root / sid / "state"
    assert not state.exists() or list(state.iterdir()) == []  # no partial copy, under the name or a scratch one
    monkeypatch.undo()
    assert c.get("/v1/checkpoints", params={"session_id": sid}, headers=MINE).json() == []
    step = {"kind": "optim_step", "seq": 2, "idempotency_key": "full-2", "adam_params": {"learning_rate": 1e-3}}
    r = c.post(ops, json=step, headers=MINE)
    assert r.status_code == 200 and r.json()["result"]["step"] == 1, r.text  # not poisoned
    r = c.post(ops, json={**save, "seq": 3, "idempotency_key": "full-3"}, headers=MINE)
    assert r.status_code == 200 and r.json()["result"]["step"] == 1, r.text  # the name is free


def test_a_create_the_disk_cannot_journal_is_a_507_and_leaves_no_session_running(c, worker, tiny, monkeypatch):
    """A create whose line in ``.owners.jsonl`` could not be written (a full disk) was a 500, and the session it had
    made ran on unowned until the idle reaper. It is a 507 with a fix; the session is stopped; a later create works."""
    import errno
    from pathlib import Path

    before = set(worker.backend.engine.sessions)
    real_open = Path.open

    def full_disk(self, mode="r", *args, **kwargs):
        if self.name == ".owners.jsonl" and "a" in mode:
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", full_disk)
    err = assert_refused(c.post("/v1/sessions", json={"base_model": tiny, "rank": 2}, headers=MINE), status=507)
    assert err["type"] == "InsufficientStorageError" and "delete_checkpoint" in err["fix"], err
    assert set(worker.backend.engine.sessions) == before  # stopped, not leaked
    monkeypatch.undo()
    assert c.post("/v1/sessions", json={"base_model": tiny, "rank": 2}, headers=MINE).status_code == 200


def test_logprobs_refusals_name_the_routes_field_tokens(c, ids):
    """The sampler's checks named ``prompt``, a field ``/v1/samplers/{id}/logprobs`` does not take."""
    for tokens in ([1, 10**6], [1] * 5000):
        assert_refused(send(c, "POST", f"/v1/samplers/{ids['smp']}/logprobs", {"tokens": tokens}, MINE), "tokens")


def test_the_server_is_healthy_after_all_this(c, tiny):
    assert_healthy(c, tiny)


def test_one_requests_failure_in_a_batch_fails_only_itself(worker, tiny, ids):
    """Engine level: a request that passes validation but fails inside a batched generation is run again
    alone, so the requests batched with it still succeed."""
    from asyncsess.types import SamplingParams
    from asyncsess_local.engine import SampleWork
    from asyncsess_local.sampler import SampleJob

    engine = worker.backend.engine
    ref = engine.samplers[ids["smp"]]
    gate = threading.Event()
    blocker = engine.call_soon(gate.wait)  # hold the engine thread so the samples below share one batch
    good = [SampleJob([5, 6], 2, SamplingParams(max_tokens=2, seed=i), max_tokens=2) for i in range(3)]
    bad = SampleJob(
        [5, 6], 1, SamplingParams.model_construct(max_tokens=2, temperature=1.0, top_p=1.0, top_k=-1, stop=None, seed=2**70), max_tokens=2
    )
    works = [SampleWork(ref.slot, j) for j in (good[0], bad, good[1], good[2])]
    batches = engine.stats["sample_batches"]
    dones = [engine.submit(w) for w in works]
    gate.set()
    import anyio

    async def collect():
        await blocker.wait()
        out = []
        for d in dones:
            try:
                out.append(await d.wait())
            except Exception as err:
                out.append(err)
        return out

    results = anyio.run(collect)
    assert engine.stats["sample_batches"] == batches + 1  # they were batched together
    assert isinstance(results[1], Exception)
    assert [len(r.sequences) for i, r in enumerate(results) if i != 1] == [2, 2, 2]


@pytest.mark.parametrize(
    ("status", "content", "expected", "field"),
    [
        (
            413,
            b'{"error":{"type":"InvalidInputError","message":"body: too large","field":"body","fix":"send less"}}',
            "InvalidInputError",
            "body",
        ),
        (
            401,
            b'{"error":{"type":"InvalidInputError","message":"key","field":"Authorization","fix":"send a key"}}',
            "InvalidInputError",
            "Authorization",
        ),
        (404, b'{"error":{"type":"SessionGoneError","message":"no session"}}', "SessionGoneError", None),
        (502, b"<html>bad gateway</html>", "TransientError", None),
        (400, b"not json", "InvalidInputError", None),
        (200, b"not json", "ServerError", None),
    ],
)
def test_the_http_client_maps_every_answer_to_a_typed_error(status, content, expected, field):
    import anyio

    from asyncsess import errors
    from asyncsess.backends.http import HttpBackend

    backend = HttpBackend(
        "http://worker.invalid", api_key=KEY, transport=httpx.MockTransport(lambda request: httpx.Response(status, content=content))
    )

    async def call():
        try:
            await backend.heartbeat("lora-1")
        finally:
            await backend.aclose()

    with pytest.raises(getattr(errors, expected)) as exc:
        anyio.run(call)
    assert getattr(exc.value, "field", None) == field


def test_open_sessions_and_samplers_per_key_are_capped(tiny, tmp_path):
    from .server_helpers import THEIRS

    w = start_worker(tiny, str(tmp_path), max_live_per_key=3)
    try:
        with httpx.Client(base_url=w.url, timeout=120) as c:
            held = [new_session(c, tiny, MINE), new_sampler(c, MINE, base_model=tiny), new_session(c, tiny, MINE)]
            assert_refused(c.post("/v1/sessions", json={"base_model": tiny}, headers=MINE), "base_model")
            assert_refused(c.post("/v1/samplers", json={"base_model": tiny}, headers=MINE), "base_model")
            assert new_session(c, tiny, THEIRS)  # the other key has its own allowance
            assert c.delete(f"/v1/sessions/{held[1]}", headers=MINE).status_code == 204
            assert new_sampler(c, MINE, base_model=tiny)
    finally:
        w.stop()


def test_the_sampler_falls_back_to_greedy_on_non_finite_probabilities():
    """Weights trained into NaN or logits at ±inf must not fail the batch: such a row takes the arg-max."""
    from asyncsess.types import SamplingParams
    from asyncsess_local.sampler import SampleJob, TorchSampler, _Row

    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0], [float("nan"), 1.0, 3.0, float("nan")], [0.0, float("inf"), 1.0, 0.0]])
    jobs = [SampleJob([1], 1, SamplingParams(temperature=1.0, seed=i), max_tokens=1) for i in range(3)]
    rows = [_Row(job=i, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    chosen = TorchSampler._choose(None, logits, rows, jobs)  # type: ignore[arg-type]
    assert chosen.tolist()[1:] == [2, 1] and 0 <= chosen[0] < 4


def test_a_seq_and_key_resent_with_another_op_is_refused_and_a_true_retry_answered(c, worker, tiny):
    """The worker answered an optim_step re-sent under a forward's seq and key with the forward's outputs."""
    sid = new_session(c, tiny, MINE)
    datum = {"model_input": [5, 6], "loss_fn_inputs": {"target_tokens": [6, 7], "weights": [1.0, 1.0]}}
    first = {"kind": "forward", "seq": 1, "idempotency_key": "k", "loss_fn": "cross_entropy", "data": [datum]}
    r = c.post(f"/v1/sessions/{sid}/ops", json=first, headers=MINE)
    assert r.status_code == 200, r.text
    for other in (
        {"kind": "optim_step", "seq": 1, "idempotency_key": "k", "adam_params": {"learning_rate": 1e-3}},
        {"kind": "save_state", "seq": 1, "idempotency_key": "k", "name": "x"},
    ):
        err = assert_refused(send(c, "POST", f"/v1/sessions/{sid}/ops", other, MINE), "idempotency_key", status=409)
        assert "another op" in err["message"] and err["type"] == "ConflictError", err
    again = c.post(f"/v1/sessions/{sid}/ops", json=first, headers=MINE)
    assert again.status_code == 200 and again.json() == r.json()
    assert worker.backend.next_seq(sid) == 2 and not worker.backend.engine.store.list(sid)  # nothing else ran


def test_conflicts_with_the_workers_state_are_409s_the_client_raises_as_conflict_errors(c, worker, tiny, ids):
    """A seq reused under another key and a request_id reused for another sample were 400s, as if the body were
    malformed; they are 409 ConflictErrors (as a reused Idempotency-Key was), which the client raises as such."""
    import anyio

    from asyncsess.backends import SampleRequest
    from asyncsess.backends.http import HttpBackend
    from asyncsess.errors import ConflictError, is_retryable
    from asyncsess.types import SamplingParams

    sid = new_session(c, tiny, MINE)
    first = {"kind": "optim_step", "seq": 1, "idempotency_key": "k1", "adam_params": {}}
    assert c.post(f"/v1/sessions/{sid}/ops", json=first, headers=MINE).status_code == 200
    err = assert_refused(c.post(f"/v1/sessions/{sid}/ops", json={**first, "idempotency_key": "k2"}, headers=MINE), "seq", status=409)
    assert err["type"] == "ConflictError", err
    sample = {"prompt": [5, 6], "sampling_params": {"max_tokens": 2, "seed": 1}, "request_id": "r-1"}
    assert c.post(f"/v1/samplers/{ids['smp']}/sample", json=sample, headers=MINE).status_code == 200
    other = {**sample, "prompt": [5, 7]}
    err = assert_refused(c.post(f"/v1/samplers/{ids['smp']}/sample", json=other, headers=MINE), "request_id", status=409)
    assert err["type"] == "ConflictError", err

    async def resent() -> BaseException:
        backend = HttpBackend(worker.url, api_key=KEY)
        try:
            await backend.sample(ids["smp"], SampleRequest((5, 7), 1, SamplingParams(max_tokens=2, seed=1), request_id="r-1"))
        except BaseException as exc:
            return exc
        finally:
            await backend.aclose()
        raise AssertionError("the reused request_id was answered")

    got = anyio.run(resent)
    assert isinstance(got, ConflictError) and got.field == "request_id" and not is_retryable(got), got


@pytest.mark.parametrize(
    ("extra", "field", "fix"),
    [
        ({"kind": "save_state", "ttl_seconds": 0}, "ttl_seconds", "1..316224000"),
        ({"kind": "save_state", "description": "d" * 2000}, "description", "1024 characters"),
        ({"kind": "save_state", "name": "a" + "." * 127}, "name", "letters, digits"),
    ],
)
def test_a_refusal_by_an_sdk_check_carries_that_checks_own_fix(c, worker, ids, extra, field, fix):
    """These said only "see the request schema in GET /openapi.json", the real fix buried in the message."""
    err = assert_refused(send(c, "POST", f"/v1/sessions/{ids['sid']}/ops", _op(worker, ids["sid"]) | extra, MINE), field)
    assert fix in err["fix"] and "(fix:" not in err["message"].removesuffix(f" (fix: {err['fix']})"), err


def test_creations_sent_at_once_cannot_pass_the_per_key_cap_together(tiny, tmp_path):
    """The cap was counted before the await that creates: N requests sent together all passed it (a key
    could hold max_live_per_key + its in-flight requests). Creation is held until every request has either
    entered it or been answered, so exactly the allowance gets in, whatever the scheduling."""
    from concurrent.futures import ThreadPoolExecutor

    import anyio

    w = start_worker(tiny, str(tmp_path), max_live_per_key=2)
    gate, seen = threading.Event(), threading.Condition()
    entered = answered = 0
    create = w.backend.create_sampler

    async def held_create(spec):
        nonlocal entered
        with seen:
            entered += 1
            seen.notify_all()
        await anyio.to_thread.run_sync(gate.wait)
        return await create(spec)

    w.backend.create_sampler = held_create

    def post(_):
        nonlocal answered
        with httpx.Client(base_url=w.url, timeout=120) as own:
            r = own.post("/v1/samplers", json={"base_model": tiny}, headers=MINE)
        with seen:
            answered += 1
            seen.notify_all()
        return r

    try:
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(post, i) for i in range(4)]
            with seen:
                seen.wait_for(lambda: entered + answered == 4)
            gate.set()
            out = [f.result() for f in futures]
        assert sorted(r.status_code for r in out) == [200, 200, 400, 400], [r.text for r in out]
        for r in out:
            if r.status_code == 400:
                assert_refused(r, "base_model")
        assert entered == 2
    finally:
        gate.set()
        w.stop()
