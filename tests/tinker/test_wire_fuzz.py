"""Every JSON request the Tinker door serves, built from the official SDK's own pydantic request types, with each
field (and each field of a nested params model) replaced by edge values and sent raw over HTTP: never a 5xx or a
hang, a bad value is a 4xx naming the field and changes nothing (no session, model, sampler, checkpoint or future
made; an op's turn is used up, so the model's next op runs), and an accepted value never fails the op once it runs.
Then two keys: B can never see, read, sample, load, publish, delete or poll A's objects (a 404, as for a never-issued
id). Deterministic: the values are a fixed list, the server is mock://."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pytest
from pydantic import BaseModel
from tinker import types

from .conftest import API_KEY, Server, start_server

pytestmark = pytest.mark.tinker

BASE = "mock/bigram-tiny"
OTHER_KEY = "tml-asyncsess-fuzz-other"
MISSING = object()  # the field left out
EDGES: list[Any] = [
    MISSING,
    None,
    float("nan"),
    float("inf"),
    float("-inf"),
    -0.0,
    5e-324,  # the smallest subnormal
    2**31 - 1,  # int32's largest: a seq_id that held the turn
    2**63,
    2**64,
    -(2**63),
    1e308,
    -1,
    0,
    1.5,
    True,
    "",
    "\x00",
    "\ud800",  # a lone surrogate: json.dumps sends it as the escape \ud800
    "x" * 100_000,
    "tinker://0-0-0:train:0/weights/../../etc",  # a path of no one's, climbing out
    "/etc/passwd",
    "é",
    [],
    {},
    [1, "a"],
    {"k": [None]},
]
# the requests each op's body comes from: route -> the SDK's request type
ROUTES: dict[str, type[BaseModel]] = {
    "create_session": types.CreateSessionRequest,
    "session_heartbeat": types.SessionHeartbeatRequest,
    "create_model": types.CreateModelRequest,
    "get_info": types.GetInfoRequest,
    "unload_model": types.UnloadModelRequest,  # every edge value of model_id names no model: nothing is unloaded
    "optim_step": types.OptimStepRequest,
    "save_weights": types.SaveWeightsRequest,
    "save_weights_for_sampler": types.SaveWeightsForSamplerRequest,
    "load_weights": types.LoadWeightsRequest,
    "create_sampling_session": types.CreateSamplingSessionRequest,
    "asample": types.SampleRequest,
    "retrieve_future": types.FutureRetrieveRequest,
    "sessions/search": types.SessionSearchRequest,
}
# fields the door does not read (documented): an op-form load_weights ignores the create-form fields; a sample names
# its sampler, not a path; user_metadata values are kept as text; every search owner is the key's own
IGNORED = {
    "create_session": {"sdk_version"},
    "load_weights": {"model_seq_id", "base_model", "user_metadata", "optimizer_config", "weights_access_token"},
    "asample": {"base_model", "model_path"},
    "retrieve_future": {"allow_metadata_only"},
    "sessions/search": {"owner"},
    "save_weights": {"user_metadata"},
    "save_weights_for_sampler": {"user_metadata"},
}
ORDERED = {"optim_step", "save_weights", "save_weights_for_sampler", "load_weights"}  # a model's numbered ops


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    for srv in start_server("mock://", api_keys={API_KEY, OTHER_KEY}):
        srv.door.gap_timeout = 2.0  # a turn the door failed to use up fails the probe in 2 s instead of 300
        srv.door.skip_gaps = False  # ... rather than run once the gap is skipped: these tests check every turn is used
        yield srv


@dataclass
class Wire:
    """A raw HTTP client of the door as one key, with the ids it made."""

    http: httpx.Client
    session: str = ""
    model: str = ""
    sampler: str = ""
    state: str = ""  # a training-state path it saved
    request: str = ""  # a finished request id
    seqs: Iterator[int] = field(default_factory=lambda: iter(range(1000, 10**6)))

    def post(self, route: str, body: Any) -> httpx.Response:
        raw = json.dumps(body) if not isinstance(body, bytes) else body  # NaN and inf as JSON's NaN / Infinity
        return self.http.post(f"/api/v1/{route}", content=raw, headers={"Content-Type": "application/json"})

    def result(self, resp: httpx.Response) -> Any:
        """The answer of a future (long-polled: 408 means try again)."""
        assert resp.status_code == 200, resp.text
        while True:
            got = self.http.post("/api/v1/retrieve_future", json={"request_id": resp.json()["request_id"]})
            if got.status_code != 408:
                assert got.status_code == 200, got.text
                return got.json() if got.headers["content-type"].startswith("application/json") else got.content

    def new_model(self) -> str:
        body = types.CreateModelRequest(session_id=self.session, model_seq_id=next(self.seqs), base_model=BASE)
        return str(self.result(self.post("create_model", _dump(body) | {"lora_config": {"rank": 4}}))["model_id"])


def _dump(model: BaseModel | dict[str, Any]) -> dict[str, Any]:
    return model if isinstance(model, dict) else model.model_dump(mode="json", exclude_none=True)


def _open(server: Server, key: str) -> Wire:
    w = Wire(httpx.Client(base_url=server.url, headers={"X-API-Key": key}, timeout=httpx.Timeout(60.0)))
    w.session = w.post("create_session", _dump(types.CreateSessionRequest(tags=[], user_metadata=None, sdk_version="fuzz"))).json()[
        "session_id"
    ]
    w.model = w.new_model()
    saved = w.post("save_weights", {"model_id": w.model, "seq_id": 1, "path": "base"})
    w.request = saved.json()["request_id"]
    w.state = w.result(saved)["path"]
    body = types.CreateSamplingSessionRequest(session_id=w.session, sampling_session_seq_id=next(w.seqs), base_model=BASE)
    w.sampler = w.post("create_sampling_session", _dump(body)).json()["sampling_session_id"]
    return w


def _valid(w: Wire, route: str, model: str, turn: int = 1) -> dict[str, Any]:
    """A body the door accepts, made with the SDK's request type of ``route`` (an op of ``model`` at ``turn``)."""
    return _dump(_request(w, route, model, turn))


def _request(w: Wire, route: str, model: str, turn: int = 1) -> BaseModel:
    prompt = types.ModelInput.from_ints([5, 6])
    made: dict[str, Callable[[], BaseModel]] = {
        "create_session": lambda: types.CreateSessionRequest(tags=["a"], user_metadata={"k": "v"}, sdk_version="fuzz", display_name="d"),
        "session_heartbeat": lambda: types.SessionHeartbeatRequest(session_id=w.session),
        "create_model": lambda: types.CreateModelRequest(
            session_id=w.session, model_seq_id=next(w.seqs), base_model=BASE, lora_config=types.LoraConfig(rank=4, seed=1)
        ),
        "get_info": lambda: types.GetInfoRequest(model_id=model),
        "unload_model": lambda: types.UnloadModelRequest(model_id=model),
        "optim_step": lambda: types.OptimStepRequest(optim_params=types.AdamParams(learning_rate=0.1), model_id=model, seq_id=turn),
        "save_weights": lambda: types.SaveWeightsRequest(
            model_id=model, path=f"s{turn}", seq_id=turn, ttl_seconds=3600, user_metadata={"k": "v"}
        ),
        "save_weights_for_sampler": lambda: types.SaveWeightsForSamplerRequest(
            model_id=model, path=f"p{turn}", seq_id=turn, ttl_seconds=3600
        ),
        "load_weights": lambda: types.LoadWeightsRequest(model_id=model, seq_id=turn, path=w.state, optimizer=True),
        "create_sampling_session": lambda: types.CreateSamplingSessionRequest(
            session_id=w.session, sampling_session_seq_id=next(w.seqs), base_model=BASE
        ),
        "asample": lambda: types.SampleRequest(
            sampling_session_id=w.sampler,
            seq_id=next(w.seqs),
            prompt=prompt,
            sampling_params=types.SamplingParams(max_tokens=2, seed=1, temperature=1.0),
            num_samples=1,
            prompt_logprobs=True,
            topk_prompt_logprobs=1,
        ),
        "retrieve_future": lambda: types.FutureRetrieveRequest(request_id=w.request),
        "sessions/search": lambda: types.SessionSearchRequest(limit=5),
    }
    return made[route]()


def _fields(request: BaseModel, body: dict[str, Any]) -> list[tuple[str, ...]]:
    """Every field of an SDK request as it goes on the wire (null ones too), and every field of a nested object the
    body holds (the params models, lora_config, prompt)."""
    paths: list[tuple[str, ...]] = []
    for k in request.model_dump(mode="json"):
        if k == "type":  # the request kind, which the route already says
            continue
        paths.append((k,))
        if isinstance(body.get(k), dict):
            paths += [(k, inner) for inner in body[k] if inner != "type"]
    return paths


def _with(body: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(body))
    where = out
    for part in path[:-1]:
        where = where[part]
    if value is MISSING:
        where.pop(path[-1], None)
    else:
        where[path[-1]] = value
    return out


def _sdk_refuses(route: str, body: dict[str, Any]) -> bool:
    try:
        ROUTES[route].model_validate(body)
    except ValueError:  # pydantic's ValidationError
        return True
    return False


def _state(server: Server) -> tuple[int, ...]:
    door = server.door
    return (
        len(door.sessions),
        len(door.models),
        len(door.samplers),
        len(door.checkpoints),
        len(door.promises._items),
        sum(len(s.ids) for s in door.samplers.values()),
    )


def test_every_field_of_every_request_at_its_edges(server: Server) -> None:
    w = _open(server, API_KEY)
    problems: list[str] = []
    for route in ROUTES:
        model, turn = (w.new_model(), 1) if route in ORDERED else (w.model, 1)  # an op's model, and its next seq_id
        for path in _fields(_request(w, route, w.model), _valid(w, route, w.model)):
            for value in EDGES:
                body = _with(_valid(w, route, model, turn), path, value)
                before = _state(server)
                resp = w.post(route, body)
                case = f"{route} {'.'.join(path)}={value!r:.30}: {resp.status_code} {resp.text[:300]}"
                if resp.status_code >= 500:
                    problems.append(f"5xx: {case}")
                    continue
                if resp.status_code >= 400:
                    named = (resp.json().get("field") or "") + " " + resp.json().get("error", "")
                    if not any(part in named for part in path):
                        problems.append(f"does not name the field: {case}")
                    if len(resp.content) > 8192:  # a refusal names the field; it does not echo 100k characters back
                        problems.append(f"a {len(resp.content)}-byte refusal: {case}")
                    if _state(server) != before:
                        problems.append(f"a refusal changed the door's state {before} -> {_state(server)}: {case}")
                elif value is not MISSING and value is not None and path[0] not in IGNORED.get(route, ()) and _sdk_refuses(route, body):
                    problems.append(f"accepted what the SDK's {ROUTES[route].__name__} refuses: {case}")
                if resp.status_code < 400 and "request_id" in resp.json() and route != "retrieve_future":
                    answer = w.result(resp)
                    if isinstance(answer, dict) and "error" in answer:
                        problems.append(f"accepted, then failed when run: {case} -> {str(answer)[:300]}")
                if route in ORDERED:  # the model's next op runs: a refused op used up its turn (unless it named no turn)
                    turn += 0 if path[0] in ("model_id", "seq_id") and resp.status_code >= 400 else 1
                    probe = {"model_id": model, "seq_id": turn, "optim_params": {"learning_rate": 0.01}}
                    answer = w.result(w.post("optim_step", probe))
                    turn += 1
                    if "error" in answer:
                        problems.append(f"the model's next op failed: {case} -> {str(answer)[:300]}")
                        model, turn = w.new_model(), 1  # the next cases start on a model that works
    assert not problems, "\n".join(problems[:40]) + f"\n({len(problems)} in all)"


def test_another_key_cannot_reach_a_tenants_objects(server: Server) -> None:
    """Key B gets, for each of key A's ids, the 404 of an id never issued (same status, same field), lists none of
    them, and changes nothing of A's."""
    a, b = _open(server, API_KEY), _open(server, OTHER_KEY)
    sampler_path = a.result(a.post("save_weights_for_sampler", {"model_id": a.model, "seq_id": 2, "path": "s"}))["path"]
    fake = {"session": "0-0-0", "model": "0-0-0:train:0", "sampler": "0-0-0:sample:0", "request": "0-0-0:x:1"}
    fake |= {"state": "tinker://0-0-0:train:0/weights/base", "sampler_path": "tinker://0-0-0:train:0/sampler_weights/s"}

    def attempts(ids: dict[str, str], turn: int) -> list[tuple[str, str, dict[str, Any] | None]]:
        run, ck = f"/training_runs/{ids['model']}", f"/training_runs/{ids['model']}/checkpoints/weights/base"
        prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]}
        return [
            ("GET", run, None),
            ("GET", f"{run}/checkpoints", None),
            ("GET", f"/sessions/{ids['session']}", None),
            ("GET", f"/samplers/{ids['sampler']}", None),
            ("POST", f"{ck}/publish", None),
            ("DELETE", f"{ck}/publish", None),
            ("PUT", f"{ck}/ttl", {"ttl_seconds": 60}),
            ("DELETE", ck, None),
            ("PUT", f"/sessions/{ids['session']}/project", {"project_id": "p"}),
            ("POST", f"/sessions/{ids['session']}/finish", {"reason": {"type": "success"}}),
            ("POST", "/session_heartbeat", {"session_id": ids["session"]}),
            ("POST", "/get_info", {"model_id": ids["model"]}),
            ("POST", "/weights_info", {"tinker_path": ids["state"]}),
            ("POST", "/retrieve_future", {"request_id": ids["request"]}),
            ("POST", "/create_model", {"session_id": ids["session"], "model_seq_id": 77, "base_model": BASE, "lora_config": {"rank": 4}}),
            ("POST", "/optim_step", {"model_id": ids["model"], "seq_id": 3, "adam_params": {"learning_rate": 0.5}}),
            ("POST", "/save_weights", {"model_id": ids["model"], "seq_id": 3, "path": "stolen"}),
            ("POST", "/unload_model", {"model_id": ids["model"]}),
            ("POST", "/load_weights", {"model_id": b.model, "seq_id": turn, "path": ids["state"], "optimizer": True}),
            ("POST", "/load_weights", {"session_id": b.session, "model_seq_id": 78, "path": ids["state"], "optimizer": True}),
            (
                "POST",
                "/create_sampling_session",
                {"session_id": b.session, "sampling_session_seq_id": 79, "model_path": ids["sampler_path"]},
            ),
            ("POST", "/create_sampling_session", {"session_id": ids["session"], "sampling_session_seq_id": 80, "base_model": BASE}),
            (
                "POST",
                "/asample",
                {"sampling_session_id": ids["sampler"], "seq_id": 1, "prompt": prompt, "sampling_params": {"max_tokens": 2}},
            ),
        ]

    mine = {"session": a.session, "model": a.model, "sampler": a.sampler, "request": a.request, "state": a.state}
    for (method, path, body), (_, _, never_body) in zip(attempts(mine | {"sampler_path": sampler_path}, 2), attempts(fake, 3)):
        got = b.http.request(method, f"/api/v1{path}", json=body)
        never = b.http.request(
            method, f"/api/v1{path.replace(a.model, fake['model']).replace(a.session, fake['session'])}", json=never_body
        )
        assert got.status_code == 404 and never.status_code == 404, (method, path, got.text, never.text)
        assert got.json()["field"] == never.json()["field"], (method, path, got.text, never.text)
    listed = json.dumps(
        [
            b.http.get("/api/v1/training_runs").json(),
            b.http.get("/api/v1/checkpoints").json(),
            b.http.get("/api/v1/sessions").json(),
            b.post("sessions/search", {"limit": 200}).json(),
        ]
    )
    assert a.session not in listed and a.model not in listed and b.session in listed
    assert "error" not in b.result(b.post("optim_step", {"model_id": b.model, "seq_id": 4, "adam_params": {"learning_rate": 0.01}}))
    # A's objects are as they were: its session is open, its checkpoints listed and private, its model trains
    assert a.post("session_heartbeat", {"session_id": a.session}).status_code == 200
    cks = a.http.get(f"/api/v1/training_runs/{a.model}/checkpoints").json()["checkpoints"]
    assert sorted(c["tinker_path"] for c in cks) == sorted([a.state, sampler_path]) and not any(c["public"] for c in cks)
    assert "error" not in a.result(a.post("optim_step", {"model_id": a.model, "seq_id": 3, "adam_params": {"learning_rate": 0.01}}))


@pytest.mark.parametrize("route", ["optim_step", "forward_backward"])
def test_a_seq_id_far_ahead_of_the_queue_is_refused_and_holds_nothing(server: Server, route: str) -> None:
    """A seq_id of 2**31-1 (or any past the model's window) was taken: its future waited, for requests that never
    come, until the door's gap timeout (300 s), and its promise and op were held meanwhile. Now it is a 400 naming
    seq_id, before anything is queued, and the model's next requests run at once, in order."""
    from asyncsess.serve import tinker_proto
    from asyncsess.serve.tinker_api import SEQ_WINDOW
    from asyncsess.types import Datum, ModelInput

    w = _open(server, API_KEY)
    model = w.new_model()
    datum = Datum(model_input=ModelInput.from_ints([5, 6]), loss_fn_inputs={"target_tokens": [6, 7], "weights": [1.0, 1.0]})

    def send(seq: int) -> httpx.Response:
        if route == "optim_step":
            return w.post(route, {"model_id": model, "seq_id": seq, "adam_params": {"learning_rate": 0.01}})
        body = tinker_proto.encode_forward_backward(model, seq, [datum], "cross_entropy")
        return w.http.post("/api/v1/forward_backward", content=body, headers={"Content-Type": "application/x-protobuf"})

    far = (2**31 - 1, 1 + SEQ_WINDOW) if route == "forward_backward" else (2**31 - 1, 2**31, 2**62 - 1, 1 + SEQ_WINDOW)  # int32 on protobuf
    for seq in far:
        before = _state(server), dict(server.door.models[model].thunks)
        resp = send(seq)
        assert resp.status_code == 400, (seq, resp.text)
        assert resp.json()["field"] == "seq_id" and str(seq) in resp.json()["error"]
        assert (_state(server), dict(server.door.models[model].thunks)) == before
    for seq in (1, 2, SEQ_WINDOW):  # the window's last seq is taken; the queue runs 1 and 2 meanwhile
        resp = send(seq)
        assert resp.status_code == 200, resp.text
        if seq < SEQ_WINDOW:
            assert not (isinstance(answer := w.result(resp), dict) and "error" in answer), answer


def _fb_cases() -> dict[str, Callable[[Any], Any]]:
    """Edits of a valid ForwardBackwardRequest protobuf (``msg``), each returning the message or the raw body to send."""
    nan, inf = float("nan"), float("inf")

    def setf(name: str, value: Any) -> Callable[[Any], Any]:
        def edit(msg: Any) -> Any:
            setattr(msg, name, value)
            return msg

        return edit

    def tensor(field: str, **changes: Any) -> Callable[[Any], Any]:
        def edit(msg: Any) -> Any:
            t = msg.data[0].loss_fn_inputs[field]
            if "values" in changes:
                t.dense = np.asarray(changes["values"], dtype="<f4" if field == "weights" else "<i8").tobytes()
            if "shape" in changes:
                del t.shape[:]
                t.shape.extend(changes["shape"])
            if "dtype" in changes:
                t.dtype = changes["dtype"]
            if "raw" in changes:
                t.dense = changes["raw"]
            if "csr" in changes:
                shape, values, crow, col = changes["csr"]
                t.ClearField("dense")
                del t.shape[:]
                t.shape.extend(shape)
                t.sparse_csr.values = np.asarray(values, dtype="<i8").tobytes()
                t.sparse_csr.crow_indices = np.asarray(crow, dtype="<i8").tobytes()
                t.sparse_csr.col_indices = np.asarray(col, dtype="<i8").tobytes()
            return msg

        return edit

    def config(key: str, value: Any) -> Callable[[Any], Any]:
        def edit(msg: Any) -> Any:
            if isinstance(value, str):
                msg.loss_fn_config_v2[key].text = value
            else:
                msg.loss_fn_config[key] = value
                msg.loss_fn_config_v2[key].number = value
            return msg

        return edit

    def tokens(raw: bytes) -> Callable[[Any], Any]:
        def edit(msg: Any) -> Any:
            msg.data[0].model_input[0].encoded_text.tokens = raw
            return msg

        return edit

    def image(msg: Any) -> Any:
        msg.data[0].model_input.add().image.data = b"\x89PNG"
        return msg

    cases: dict[str, Callable[[Any], Any]] = {
        "garbage body": lambda msg: b"\xff\x00garbage",
        "no data": lambda msg: (msg.ClearField("data"), msg)[1],
        "image chunk": image,
        "odd token bytes": tokens(b"\x01\x02\x03"),
        "negative token": tokens(np.asarray([5, -1], dtype="<i4").tobytes()),
        "token 2**31-1": tokens(np.asarray([5, 2**31 - 1], dtype="<i4").tobytes()),
    }
    cases |= {f"seq_id={v}": setf("seq_id", v) for v in (0, -1, -(2**31), 2**31 - 1)}
    for v in ("", "\x00", "x" * 100_000, "é", "0-0-0:train:0"):
        cases[f"model_id={v!r:.20}"] = setf("model_id", v)
    for v in ("", "\x00", "x" * 100_000, "nope", "stable_reinforce", "../cross_entropy"):
        cases[f"loss_fn={v!r:.20}"] = setf("loss_fn", v)
    for v in (nan, inf, -inf, 5e-324, 1e308, "text"):
        cases[f"loss_fn_config={v!r}"] = config("clip_low_threshold", v)
    cases["loss_fn_config unknown key"] = config("x" * 1000, 1.0)
    for v in (nan, inf, -inf, 1e-45, 3e38, -1e30):
        cases[f"weights={v!r}"] = tensor("weights", values=[1.0, v])
    for v in (-1, 2**31 - 1, 2**62):
        cases[f"target_tokens={v}"] = tensor("target_tokens", values=[6, v])
    for v in (0, 3, 4, 99):
        cases[f"weights dtype={v}"] = tensor("weights", dtype=v)
    for shape in ([5], [-1, -2], [2**40], [0], [1, 2, 1, 1], [-2, -1]):
        cases[f"weights shape={shape}"] = tensor("weights", shape=shape)
    cases["weights odd bytes"] = tensor("weights", raw=b"\x00" * 7)
    for shape in ([2**31, 2**31], [2**20, 2**20], [-1, 2], [2, -1], [2], [2, 1, 1]):
        cases[f"target csr shape={shape}"] = tensor("target_tokens", csr=(shape, [6, 7], [0, 1, 2], [0, 0]))
    cases["target csr bad indices"] = tensor("target_tokens", csr=([2, 1], [6, 7], [0, 5, 2], [0, 9]))
    cases["target csr negative col"] = tensor("target_tokens", csr=([2, 1], [6, 7], [0, 1, 2], [0, -3]))
    cases["target csr repeated cell"] = tensor("target_tokens", csr=([2, 2], [6, 7], [0, 2, 2], [1, 1]))

    def odd_values(msg: Any) -> Any:
        msg = tensor("target_tokens", csr=([2, 1], [6, 7], [0, 1, 2], [0, 0]))(msg)
        msg.data[0].loss_fn_inputs["target_tokens"].sparse_csr.values = b"\x00" * 15
        return msg

    cases["target csr odd value bytes"] = odd_values
    return cases


def test_forward_backward_protobuf_at_its_edges(server: Server) -> None:
    """Every field of the protobuf forward_backward (the SDK's hot path, which the JSON fuzz does not reach) at its
    edges, sent raw (and zstd-compressed): never a 5xx or a hang; a refusal is a 4xx naming the field that changes
    nothing but the op's turn, and the model's next op runs."""
    from tinker.proto import tinker_public_pb2 as pb

    from asyncsess.serve import tinker_proto
    from asyncsess.types import Datum, ModelInput

    w = _open(server, API_KEY)
    good = Datum(model_input=ModelInput.from_ints([5, 6]), loss_fn_inputs={"target_tokens": [6, 7], "weights": [1.0, 1.0]})
    problems: list[str] = []

    def fb(model: str, seq: int) -> bytes:
        return tinker_proto.encode_forward_backward(model, seq, [good], "cross_entropy")

    def send(body: bytes, zstd: bool = False) -> httpx.Response:
        headers = {"Content-Type": "application/x-protobuf"} | ({"Content-Encoding": "zstd"} if zstd else {})
        return w.http.post("/api/v1/forward_backward", content=tinker_proto.compress(body) if zstd else body, headers=headers)

    for zstd in (False, True):
        for name, edit in _fb_cases().items():
            model = w.new_model()
            msg = pb.ForwardBackwardRequest()
            msg.ParseFromString(fb(model, 1))
            body = edit(msg)
            raw = body if isinstance(body, bytes) else body.SerializeToString()
            before = _state(server)
            try:
                resp = send(raw, zstd)
            except httpx.TransportError as err:  # the server dropped the connection: an unhandled error
                problems.append(f"no answer: {name}{' (zstd)' if zstd else ''}: {err!r}")
                continue
            case = f"{name}{' (zstd)' if zstd else ''}: {resp.status_code} {resp.text[:300]}"
            if resp.status_code >= 500:
                problems.append(f"5xx: {case}")
                continue
            turn_used = True
            if resp.status_code >= 400:
                answer = resp.json()
                if not answer.get("field"):
                    problems.append(f"names no field: {case}")
                if len(resp.content) > 8192:
                    problems.append(f"a {len(resp.content)}-byte refusal: {case}")
                if _state(server) != before:
                    problems.append(f"a refusal changed the door's state {before} -> {_state(server)}: {case}")
                turn_used = answer.get("field") not in ("body", "model_id", "seq_id", "Content-Encoding")
            else:
                got = w.result(resp)
                if isinstance(got, dict) and "error" in got:
                    problems.append(f"accepted, then failed when run: {case} -> {str(got)[:300]}")
            probe = w.result(send(fb(model, 2 if turn_used else 1)))
            if isinstance(probe, dict) and "error" in probe:
                problems.append(f"the model's next op failed: {case} -> {str(probe)[:300]}")
    assert not problems, "\n".join(problems[:40]) + f"\n({len(problems)} in all)"


PATH_EDGES = ["%00", "%ED%A0%80", "%FF", "..", "..%2F..%2Fetc", "a%2F..%2F..", "x" * 4000, "%C3%A9", "0-0-0:train:0", " ", "%20%0A"]
QUERY_EDGES = ["-1", "0", str(2**63), str(2**64), "1e3", "NaN", "abc", "", "%00", "1.5"]


def test_a_base_model_that_is_no_model_name_is_refused_by_every_create(server: Server) -> None:
    """load_weights' create form (session_id + model_seq_id, as create_training_client_from_state sends it) took any
    JSON as base_model: 5, a list or a NUL was accepted, then failed when run, echoing a 100,000-character name back;
    create_model and create_sampling_session took that name and kept it."""
    w = _open(server, API_KEY)
    creates = {
        "load_weights": lambda bad: {"session_id": w.session, "model_seq_id": next(w.seqs), "path": w.state, "base_model": bad},
        "create_model": lambda bad: {"session_id": w.session, "model_seq_id": next(w.seqs), "base_model": bad, "lora_config": {"rank": 4}},
        "create_sampling_session": lambda bad: {"session_id": w.session, "sampling_session_seq_id": next(w.seqs), "base_model": bad},
    }
    for route, body in creates.items():
        for bad in [5, ["x"], True, "a\x00b", "\ud800", " ", "x" * 100_000] if route == "load_weights" else ["x" * 100_000]:
            before = _state(server)
            resp = w.post(route, body(bad))
            assert resp.status_code == 400 and resp.json()["field"] == "base_model", (route, repr(bad)[:20], resp.text[:300])
            assert len(resp.content) < 8192 and _state(server) == before
    assert w.result(w.post("load_weights", creates["load_weights"](BASE)))["model_id"]


def test_rest_routes_with_edge_ids_and_pages(server: Server) -> None:
    """The REST routes take ids in the URL path and pages in the query, which the JSON fuzz does not reach: each edge
    value (NUL, bad UTF-8, climbing paths, 4,000 characters, another run's id) in each path parameter, and each
    edge value of limit / offset, is a 4xx naming a field or a 2xx, never a 5xx or a dropped connection, and
    changes nothing."""
    w = _open(server, API_KEY)
    ck = w.state.split("/", 3)[3]  # "weights/base"
    templates = [
        ("GET", "/training_runs/{m}", None),
        ("GET", "/training_runs/{m}/checkpoints", None),
        ("PUT", "/training_runs/{m}/checkpoints/{c}/ttl", {"ttl_seconds": 3600}),
        ("POST", "/training_runs/{m}/checkpoints/{c}/publish", None),
        ("DELETE", "/training_runs/{m}/checkpoints/{c}/publish", None),
        ("DELETE", "/training_runs/{m}/checkpoints/{c}", None),
        ("GET", "/sessions/{s}", None),
        ("PUT", "/sessions/{s}/project", {"project_id": "p"}),
        ("POST", "/sessions/{s}/finish", {"reason": {"type": "success"}}),
        ("GET", "/samplers/{s}", None),
    ]
    problems: list[str] = []

    def call(method: str, path: str, body: Any) -> None:
        before = _state(server)
        try:
            resp = w.http.request(method, f"/api/v1{path}", json=body)
        except httpx.TransportError as err:
            problems.append(f"no answer: {method} {path[:80]}: {err!r}")
            return
        case = f"{method} {path[:80]}: {resp.status_code} {resp.text[:200]}"
        if resp.status_code >= 500:
            problems.append(f"5xx: {case}")
        elif resp.status_code >= 400:
            try:
                named = resp.json().get("field")
            except ValueError:
                named = None
            if not named:
                problems.append(f"names no field: {case}")
            if _state(server) != before:
                problems.append(f"a refusal changed the door's state: {case}")

    for method, template, body in templates:
        for edge in PATH_EDGES:
            for key in ("m", "c", "s"):
                if "{" + key + "}" not in template:
                    continue
                ids = {"m": w.model, "c": ck, "s": w.session if "sessions" in template else w.sampler} | {key: edge}
                call(method, template.format(**ids), body)
    for route in ("/training_runs", "/checkpoints", "/sessions"):
        for param in ("limit", "offset"):
            for edge in QUERY_EDGES:
                call("GET", f"{route}?{param}={edge}", None)
    # the tenant's objects are as they were: its session open, its checkpoint listed and private, its model trains
    assert w.post("session_heartbeat", {"session_id": w.session}).status_code == 200
    assert [c["public"] for c in w.http.get(f"/api/v1/training_runs/{w.model}/checkpoints").json()["checkpoints"]] == [False]
    assert not problems, "\n".join(problems[:40]) + f"\n({len(problems)} in all)"


def test_finish_takes_tinkers_reasons_only(server: Server) -> None:
    """sessions/{id}/finish took any reason and detail (a list, a number, 100,000 characters, a lone surrogate) and
    finished the session with it: such a session then had no status in searches, as if the server had expired it.
    Now a reason other than Tinker's three, or a detail that is not clean text of at most 65,536 characters, is a 400
    naming the field and the session stays open; the SDK's own reasons finish it."""
    w = _open(server, API_KEY)
    problems: list[str] = []
    for key in ("reason", "detail"):
        for value in EDGES:
            session = w.post("create_session", {"tags": [], "sdk_version": "fuzz"}).json()["session_id"]
            body = _with({"reason": {"type": "errored"}, "detail": "boom"}, (key,), value)
            resp = w.post(f"sessions/{session}/finish", body)
            case = f"{key}={value!r:.30}: {resp.status_code} {resp.text[:200]}"
            open_now = w.post("session_heartbeat", {"session_id": session}).status_code == 200
            if resp.status_code >= 400:
                if resp.status_code >= 500 or resp.json().get("field") != key:
                    problems.append(f"not a 4xx naming {key}: {case}")
                if not open_now:
                    problems.append(f"a refusal finished the session: {case}")
            else:
                valid = value in (MISSING, None) or (key == "detail" and isinstance(value, str) and len(value) <= 65536)
                if not valid or value in ("\x00", "\ud800"):
                    problems.append(f"finished with it: {case}")
                if open_now:
                    problems.append(f"answered 200 and left the session open: {case}")
    found = w.post("sessions/search", {"limit": 200, "statuses": [{"type": "client_finished", "reasons": ["errored"]}]}).json()
    assert len(found["sessions"]) >= 2  # the accepted ones are listed with their reason
    assert not problems, "\n".join(problems[:40]) + f"\n({len(problems)} in all)"


def test_the_seq_id_window_runs_from_the_first_missing_request_not_the_last_run(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that pipelines its requests (sends them all, in order, before any has run) is never refused: the
    window starts at the first seq_id not received, however far behind the backend runs."""
    import threading

    import anyio

    w = _open(server, API_KEY)
    model = w.new_model()
    backend_id = server.door.models[model].backend_id
    gate = threading.Event()
    real = server.backend.execute_training

    async def held(session_id: str, op: Any) -> Any:
        if session_id == backend_id:
            await anyio.to_thread.run_sync(gate.wait)
        return await real(session_id, op)

    monkeypatch.setattr(server.backend, "execute_training", held)
    monkeypatch.setattr(server.door, "seq_window", 8)
    try:
        sent = [w.post("optim_step", {"model_id": model, "seq_id": seq, "adam_params": {"learning_rate": 0.01}}) for seq in range(1, 21)]
        assert [r.status_code for r in sent] == [200] * 20  # 20 queued, none run: all within the window
        assert server.door.models[model].sequencer.next_seq == 1
        far = w.post("optim_step", {"model_id": model, "seq_id": 29, "adam_params": {"learning_rate": 0.01}})
        assert far.status_code == 400 and far.json()["field"] == "seq_id"  # 8 past the first missing one (21)
    finally:
        gate.set()
    assert all("error" not in w.result(r) for r in sent)


def test_a_released_sampler_is_410_to_its_owner_and_404_to_another_key(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _open(server, API_KEY), _open(server, OTHER_KEY)
    monkeypatch.setattr(server.door, "max_samplers", 1)
    ids = []
    for turn in (2, 3):  # two refreshes: the first sampler is released when the second opens
        body = {"model_id": a.model, "seq_id": turn, "sampling_session_seq_id": 500 + turn}
        ids.append(a.result(a.post("save_weights_for_sampler", body))["sampling_session_id"])
    assert ids[0] not in server.door.samplers and ids[1] in server.door.samplers
    mine, theirs = a.http.get(f"/api/v1/samplers/{ids[0]}"), b.http.get(f"/api/v1/samplers/{ids[0]}")
    never = b.http.get(f"/api/v1/samplers/{ids[0].split(':')[0]}:sample:99999")
    assert mine.status_code == 410 and "released" in mine.json()["error"]
    assert theirs.status_code == never.status_code == 404 and theirs.json()["field"] == never.json()["field"]


def test_another_keys_refreshes_never_push_out_a_keys_released_sampler_records(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ids of released samplers (answered 410 saying why) were one table for every key, trimmed to its newest
    4,096: another key's refreshes pushed a key's records out, and its released sampler became a 404. Each key now
    keeps its own newest ``KEEP_RELEASED``."""
    from asyncsess.serve import tinker_api

    a, b = _open(server, API_KEY), _open(server, OTHER_KEY)
    monkeypatch.setattr(server.door, "max_samplers", 1)
    monkeypatch.setattr(tinker_api, "KEEP_RELEASED", 2)

    def refresh(w: Wire, turn: int) -> str:
        body = {"model_id": w.model, "seq_id": turn, "sampling_session_seq_id": 600 + turn}
        return str(w.result(w.post("save_weights_for_sampler", body))["sampling_session_id"])

    mine = refresh(a, 2)
    refresh(a, 3)  # releases mine
    for turn in range(2, 8):  # the other key releases five
        refresh(b, turn)
    got = a.http.get(f"/api/v1/samplers/{mine}")
    assert got.status_code == 410 and "released" in got.json()["error"], got.text
