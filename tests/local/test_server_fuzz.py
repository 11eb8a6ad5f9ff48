"""Property-based fuzz of the whole worker API (issue 11): no input gets a 5xx, every refusal is a JSON
4xx naming the field and the fix, and the server is healthy afterwards, on the same connection.

Two generators: schemathesis, driven by the worker's own ``/openapi.json`` (every operation, valid and
invalid data, with random ids and with the real ids of live objects), and hypothesis, which takes a valid
request to each route and replaces a few of its fields (nested ones included) with edge values: NaN,
±inf, subnormals, values past float32, huge and negative integers, NUL, lone surrogates, 5,000-character
strings, filesystem paths. ``ASYNCSESS_FUZZ_EXAMPLES`` (default 10) scales both; ``ASYNCSESS_FUZZ_REPORT``
names a JSON file to write the counts to (docs/backend-local.md reports a large run).

The one 5xx the worker may give valid input is the documented 503 for an op whose predecessors never
arrived (a seq gap, retried by clients); it is counted apart and must carry that error.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from collections import Counter
from typing import Any

import pytest

torch = pytest.importorskip("torch")
schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402

from .server_helpers import KEY, MINE, OTHER, assert_healthy, new_sampler, new_session, raw_json, start_worker  # noqa: E402

pytestmark = pytest.mark.local

EXAMPLES = int(os.environ.get("ASYNCSESS_FUZZ_EXAMPLES", "10"))
STATS: Counter[str] = Counter()
FAILURES: list[str] = []
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure is recorded as found, the run goes on
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def worker(tiny, tmp_path_factory):
    w = start_worker(tiny, str(tmp_path_factory.mktemp("fuzz-ckpt")), max_live_per_key=10**6)  # the cap has its own test
    yield w
    w.stop()
    report = os.environ.get("ASYNCSESS_FUZZ_REPORT")
    if report:
        with open(report, "w") as f:
            json.dump({"examples_setting": EXAMPLES, **STATS, "failures": FAILURES[:50]}, f, indent=2)


@pytest.fixture(scope="module")
def ids(c, tiny):
    sid = new_session(c, tiny, MINE)
    r = c.post(f"/v1/sessions/{sid}/ops", json={"kind": "save_state", "seq": 1, "idempotency_key": "f1", "name": "s"}, headers=MINE)
    assert r.status_code == 200, r.text
    return {"sid": sid, "smp": new_sampler(c, MINE, base_model=tiny), "state": r.json()["result"]["path"], "tiny": tiny}


def check(status: int, body: bytes, where: str) -> None:
    """Record one answer; a 5xx other than a seq-gap 503, or a 4xx without a JSON error naming field and fix, fails."""
    STATS["requests"] += 1
    STATS[f"{status // 100}xx"] += 1
    problem = None
    try:
        err = json.loads(body)["error"] if status >= 400 else None
    except (ValueError, KeyError, TypeError):
        err, problem = None, "not a JSON error body"
    if status >= 500:
        if status == 503 and err and err.get("type") == "TransientError" and "never arrived" in err.get("message", ""):
            STATS["seq_gap_503"] += 1
        else:
            problem = f"server error {status}"
    elif status >= 400 and err is not None and _openai_route(where) and set(err) == {"message", "type", "param", "code"}:
        # OpenAI's shape; ``param`` names the field (null only for a body that is not a JSON object). The
        # worker's key and size checks in front of these routes answer in the worker's shape (below).
        if not (err["message"] and (err["param"] is not None or err["code"] == "invalid_json")):
            problem = "an OpenAI refusal without param"
    elif status >= 400 and err is not None and status not in (404,):
        if not (err.get("field") and err.get("fix")):
            problem = "a refusal without field and fix"
    if problem:
        STATS["failures"] += 1
        FAILURES.append(f"{problem}: {where} -> {status} {body[:300]!r}")


def _openai_route(where: str) -> bool:
    """The OpenAI routes answer in OpenAI's error shape (the key check in front of them in the worker's)."""
    path = where.split(" ")[1] if " " in where else ""
    return (
        path in ("/v1/chat/completions", "/v1/completions", "/v1/responses")
        or re.fullmatch(r"/v1/asyncsess/rollouts/[^/]+", path) is not None
    )


def assert_clean() -> None:
    assert not FAILURES, "\n".join(FAILURES[:20])


# ------------------------------------------------------------------------------------ schemathesis


def _clamp(case: Any) -> Any:
    """Keep valid generations cheap (a few decode steps); invalid sizes are left for the server to refuse."""
    body = case.body
    if isinstance(body, dict):
        for k in ("num_samples", "n"):
            if type(body.get(k)) is int and 1 <= body[k] <= 128:
                body[k] = min(body[k], 3)
        for k in ("max_tokens", "max_completion_tokens"):
            if type(body.get(k)) is int and body[k] >= 1:
                body[k] = min(body[k], 4)
        if ("messages" in body or "model" in body) and "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = 4
        if "model" in body:  # an OpenAI body: no sampling_params
            return case
        sp = body.get("sampling_params")
        if "prompt" in body and not isinstance(sp, dict):
            body["sampling_params"] = sp = {} if sp is None else sp
        if isinstance(sp, dict) and not (type(sp.get("max_tokens")) is int and sp["max_tokens"] > 4):
            sp.setdefault("max_tokens", 4)
        if isinstance(sp, dict) and type(sp.get("max_tokens")) is int and 1 <= sp["max_tokens"]:
            sp["max_tokens"] = min(sp["max_tokens"], 4)
    return case


def _fuzz_operation(op: Any, mode: Any, path_parameters: dict[str, str] | None, url: str, session: Any) -> None:
    @SETTINGS
    @given(case=op.as_strategy(generation_mode=mode, path_parameters=path_parameters).map(_clamp))
    def run(case: Any) -> None:
        STATS["schemathesis"] += 1
        try:
            r = case.call(base_url=url, session=session, headers=MINE, timeout=120)
        except Exception as err:  # the client could not even send it (e.g. a header it refuses)
            STATS["unsendable"] += 1
            STATS[f"unsendable:{type(err).__name__}"] += 1
            return
        check(r.status_code, r.content, f"{op.method.upper()} {op.path} {mode} {case.path_parameters} {str(case.body)[:200]}")

    run()


def test_schemathesis_over_the_whole_api(worker, c, ids):
    import requests
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{worker.url}/openapi.json", headers=MINE)
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) >= 12  # every route is in the schema
    session = requests.Session()
    fixed = {"session_id": ids["sid"], "sampler_id": ids["smp"]}
    for op in operations:
        names = {p.name for p in op.path_parameters}
        variants = [None] + ([{k: v for k, v in fixed.items() if k in names}] if names and op.method.upper() != "DELETE" else [])
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            for path_parameters in variants:
                try:
                    _fuzz_operation(op, mode, path_parameters, worker.url, session)
                except Unsatisfiable:  # e.g. invalid data for a route that takes no input
                    STATS["schemathesis_variants_without_cases"] += 1
    assert STATS["schemathesis"] >= len(operations) * 2
    assert_clean()
    assert_healthy(c, ids["tiny"])


# ------------------------------------------------------------------------- hypothesis edge values

NAN, INF = float("nan"), float("inf")
EDGE_FLOATS = (
    st.sampled_from(
        [
            NAN,
            INF,
            -INF,
            0.0,
            -0.0,
            5e-324,
            2.2e-308,
            1e-300,
            1e-45,
            1e-5,
            1e30,
            1e39,
            3.4028235e38,
            1.7976931348623157e308,
            -1.0,
            0.5,
            2.0,
            10.0,
        ]
    )
    | st.floats()
)
EDGE_INTS = (
    st.sampled_from([0, -1, 1, 2, 383, 384, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, 10**100]) | st.integers()
)
EDGE_TEXT = st.sampled_from(
    [
        "",
        "\x00",
        "a\x00b",
        "\ud800",
        "x\udfff",
        "x" * 5000,
        "/",
        "/proc/self",
        "..",
        "../../etc/passwd",
        "local:///etc",
        "local://ephemeral/x/1",
        "x\n",
        "\n",
        "é",
        "🙂",
        " ",
        "tiny-llama",
        "NaN",
    ]
) | st.text(max_size=20)
EDGE = st.one_of(
    EDGE_FLOATS,
    EDGE_INTS,
    EDGE_TEXT,
    st.none(),
    st.booleans(),
    st.lists(EDGE_INTS | EDGE_FLOATS, max_size=3),
    st.dictionaries(EDGE_TEXT, EDGE_INTS, max_size=2),
)


def _templates(ids: dict[str, str], seq: int, their_sid: str) -> list[tuple[str, str, Any]]:
    """A valid request to every route (method, path, body or query)."""
    sid, smp, tiny = ids["sid"], ids["smp"], ids["tiny"]
    datum = {"model_input": [5, 6, 7], "loss_fn_inputs": {"target_tokens": [6, 7, 8], "weights": [1.0, 0.5, 1.0]}}
    rl = {"model_input": [5, 6], "loss_fn_inputs": {"target_tokens": [6, 7], "logprobs": [-1.0, -2.0], "advantages": [0.5, -0.5]}}
    op = {"seq": seq, "idempotency_key": f"e{seq}"}
    sample = {
        "prompt": [5, 6, 7],
        "num_samples": 2,
        "sampling_params": {"max_tokens": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 50, "seed": 3, "stop": ["is", 2]},
    }
    return [
        ("POST", "/v1/sessions", {"base_model": tiny, "rank": 2, "alpha": 4.0, "seed": 1, "user_metadata": {"a": "b"}}),
        ("POST", "/v1/sessions", {"base_model": tiny, "from_path": ids["state"], "with_optimizer": True}),
        ("POST", f"/v1/sessions/{sid}/ops", {"kind": "forward_backward", "loss_fn": "cross_entropy", "data": [datum], **op}),
        (
            "POST",
            f"/v1/sessions/{sid}/ops",
            {
                "kind": "forward_backward",
                "loss_fn": "ppo",
                "loss_fn_config": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
                "data": [rl],
                **op,
            },
        ),
        ("POST", f"/v1/sessions/{sid}/ops", {"kind": "forward", "loss_fn": "cross_entropy", "data": [datum], **op}),
        (
            "POST",
            f"/v1/sessions/{sid}/ops",
            {
                "kind": "optim_step",
                "adam_params": {
                    "learning_rate": 1e-3,
                    "beta1": 0.9,
                    "beta2": 0.95,
                    "eps": 1e-8,
                    "weight_decay": 0.0,
                    "grad_clip_norm": 1.0,
                },
                **op,
            },
        ),
        ("POST", f"/v1/sessions/{sid}/ops", {"kind": "save_weights", "name": f"w{seq}", "ephemeral": False, **op}),
        ("POST", f"/v1/sessions/{sid}/ops", {"kind": "save_state", "name": "s", **op}),
        ("POST", f"/v1/sessions/{sid}/ops", {"kind": "load_state", "path": ids["state"], "with_optimizer": True, **op}),
        ("POST", f"/v1/sessions/{their_sid}/ops", {"kind": "load_state", "path": ids["state"], **op}),
        ("POST", f"/v1/sessions/{sid}/heartbeat", None),
        ("POST", "/v1/samplers", {"model_path": ids["state"]}),
        ("POST", "/v1/samplers", {"base_model": tiny}),
        ("POST", f"/v1/samplers/{smp}/sample", sample),
        ("POST", f"/v1/samplers/{smp}/sample", {**sample, "include_prompt_logprobs": True, "request_id": "r"}),
        ("POST", f"/v1/samplers/{smp}/logprobs", {"tokens": [5, 6, 7, 8]}),
        ("GET", "/v1/checkpoints", {"session_id": sid}),
        ("GET", "/v1/tokenizer", {"base_model": tiny}),
        (
            "POST",
            "/v1/chat/completions",
            {
                "model": tiny,
                "messages": [{"role": "user", "content": "what is 2 plus 3?"}],
                "max_tokens": 3,
                "temperature": 0.5,
                "top_p": 0.9,
                "n": 2,
                "stop": ["\n"],
                "seed": 4,
            },
        ),
        (
            "POST",
            "/v1/chat/completions",
            {
                "model": sid,
                "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                "max_tokens": 3,
                "stream": True,
            },
        ),
        (
            "POST",
            "/v1/chat/completions",
            {
                "model": tiny,
                "messages": [
                    {"role": "user", "content": "what is 2 plus 3?"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "5"},
                ],
                "tools": [{"type": "function", "function": {"name": "calc", "description": "d", "parameters": {"type": "object"}}}],
                "max_tokens": 3,
                "logprobs": True,
                "top_logprobs": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
                "metadata": {"rollout_id": "fz"},
            },
        ),
        ("POST", "/v1/completions", {"model": tiny, "prompt": "what is", "max_tokens": 3, "logprobs": 2, "n": 2, "user": "fz"}),
        ("POST", "/v1/completions", {"model": sid, "prompt": [5, 6, 7], "max_tokens": 3, "stop": ["\n"], "seed": 1}),
        ("GET", "/v1/asyncsess/rollouts/fz", None),
    ]


def _leaves(value: Any, at: tuple = ()) -> list[tuple]:
    """Every place in a JSON value that can be replaced: the value itself and each key or item, recursively."""
    out = [at]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _leaves(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _leaves(v, (*at, i))
    return out


def _replace(value: Any, at: tuple, new: Any) -> Any:
    if not at:
        return new
    head, rest = at[0], at[1:]
    if isinstance(value, dict):
        return {**value, head: _replace(value[head], rest, new)}
    copy = list(value)
    copy[head] = _replace(value[head], rest, new)
    return copy


@st.composite
def mutated(draw: Any, templates: list[tuple[str, str, Any]]) -> tuple[str, str, Any, dict[str, Any]]:
    method, path, body = draw(st.sampled_from(templates))
    if body is not None:
        for _ in range(draw(st.integers(0, 3))):
            body = _replace(body, draw(st.sampled_from(_leaves(body))), draw(EDGE))
        if isinstance(body, dict) and draw(st.booleans()):
            body = {**body, draw(EDGE_TEXT): draw(EDGE)}  # an extra key
    parts = path.split("/")
    if len(parts) > 4 and draw(st.integers(0, 9)) == 0:  # a hostile id in the path
        parts[3] = urllib.parse.quote(draw(EDGE_TEXT).encode("utf-8", "surrogatepass"), safe="") or "x"
        path = "/".join(parts)
    headers = dict(draw(st.sampled_from([MINE] * 8 + [{"Authorization": f"Bearer {OTHER}"}, {"Authorization": b"Bearer \xff\xc3\xa9"}])))
    return method, path, body, headers


def test_edge_values_in_every_field_of_every_route(worker, c, tiny, ids):
    their_sid = new_session(c, tiny, {"Authorization": f"Bearer {OTHER}"})

    @settings(SETTINGS, max_examples=EXAMPLES * 20)
    @given(data=st.data())
    def run(data: Any) -> None:
        seq = worker.backend.next_seq(ids["sid"]) or 1
        method, path, body, headers = data.draw(mutated(_templates(ids, seq, their_sid)))
        STATS["edge"] += 1
        if method == "GET":
            try:
                params = {k: str(v) for k, v in (body or {}).items()} if isinstance(body, dict) else None
                r = c.request(method, path, params=params, headers=headers)
            except UnicodeEncodeError:  # a lone surrogate cannot even be put in a URL
                STATS["unsendable"] += 1
                return
        else:
            kw = (
                {"content": raw_json(body), "headers": {**headers, "content-type": "application/json"}}
                if body is not None
                else {"headers": headers}
            )
            r = c.request(method, path, **kw)
        check(r.status_code, r.content, f"{method} {path} {str(body)[:300]}")

    run()
    assert_clean()
    assert_healthy(c, tiny)
    assert c.get("/v1/capabilities", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
