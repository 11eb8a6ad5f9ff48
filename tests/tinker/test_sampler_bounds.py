"""The Tinker door keeps a session's samplers bounded: an RL loop that calls ``save_weights_and_get_sampling_client``
every step made a sampler (and kept its snapshot weights) on the backend each time, never closed, so a long run grew
memory and open samplers without limit. Now a session keeps its ``max_samplers`` most recently used samplers open:
an older ephemeral one is released (its sample is a 410 naming ``sampling_session_id`` that says why), one on base
weights or a saved path reopens on its next sample. All through the official SDK."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import tinker
from tinker import types

from .conftest import API_KEY, Server, start_server

pytestmark = pytest.mark.tinker

BASE = "mock/bigram-tiny"
CAP = 6
PROMPT = types.ModelInput.from_ints([5, 6])
PARAMS = types.SamplingParams(max_tokens=3, seed=7)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    for srv in start_server("mock://"):
        srv.door.max_samplers = CAP
        yield srv


@pytest.fixture()
def service(server: Server) -> Iterator[tinker.ServiceClient]:
    sc = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    yield sc
    sc.holder.close()


def _tokens(sampler: tinker.SamplingClient) -> list[int]:
    return list(sampler.sample(PROMPT, 1, PARAMS).result().sequences[0].tokens)


def _open_backend_samplers(server: Server, session_id: str) -> set[str]:
    door = server.door
    ids = {door.samplers[sid].backend_id for sid in door.sessions[session_id].samplers}
    return {i for i in ids if i is not None} & set(server.backend._samplers)  # type: ignore[attr-defined]


def test_200_sampler_refreshes_stay_bounded_and_recent_samplers_still_sample(server: Server, service: tinker.ServiceClient) -> None:
    other = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)  # another session: its sampler is not touched
    try:
        theirs = other.create_sampling_client(base_model=BASE).result()
        their_tokens = _tokens(theirs)
        their_backend = server.door.samplers[theirs._sampling_session_id].backend_id
        tc = service.create_lora_training_client(base_model=BASE, rank=4).result()
        session_id = service.holder._session_id
        assert session_id is not None
        saved = tc.save_weights_for_sampler("kept").result().path
        on_path = service.create_sampling_client(model_path=saved).result()
        on_base = service.create_sampling_client(base_model=BASE).result()
        path_tokens, base_tokens = _tokens(on_path), _tokens(on_base)
        first = tc.save_weights_and_get_sampling_client().result()
        _tokens(first)
        recent: list[tinker.SamplingClient] = []
        for step in range(200):
            tc.optim_step(types.AdamParams(learning_rate=0.01)).result()
            recent = [*recent[-2:], tc.save_weights_and_get_sampling_client().result()]
            _tokens(recent[-1])
            door_open = [s for s in server.door.samplers.values() if s.session_id == session_id and s.backend_id is not None]
            assert len(door_open) <= CAP, step
            assert len(_open_backend_samplers(server, session_id)) <= CAP, step
        # the door and the backend hold a bounded number of samplers and snapshots for the session
        assert len(server.door.sessions[session_id].samplers) <= CAP + 2  # + the two closed ones that can reopen
        backend_model = server.door.models[tc.model_id].backend_id
        snapshots = [c for c in server.backend._checkpoints.values() if c.ephemeral and c.session_id == backend_model]  # type: ignore[attr-defined]
        assert len(snapshots) <= CAP + 1
        assert sum(len(s.ids) for s in server.door.samplers.values()) <= 3 * CAP
        # the samplers the loop still uses sample; the first, released long ago, says why
        for sampler in recent:
            assert len(_tokens(sampler)) == 3
        with pytest.raises(tinker.APIStatusError) as err:
            first.sample(PROMPT, 1, PARAMS).result()
        assert err.value.status_code == 410
        assert err.value.body["field"] == "sampling_session_id"  # type: ignore[index]
        assert "save_weights_and_get_sampling_client" in err.value.body["error"]  # type: ignore[index]
        # samplers on a saved path and on base weights were closed, and reopen with the same weights
        closed = {server.door.samplers[c._sampling_session_id].backend_id for c in (on_path, on_base)}
        assert closed == {None}
        assert _tokens(on_path) == path_tokens and _tokens(on_base) == base_tokens
        # the other session's sampler stayed open and samples as before
        assert server.door.samplers[theirs._sampling_session_id].backend_id == their_backend
        assert _tokens(theirs) == their_tokens
    finally:
        other.holder.close()


def test_a_sampler_in_use_is_not_closed(server: Server, service: tinker.ServiceClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampler whose sample is running is never the one closed, however many samplers open meanwhile: the backend
    holds the sample (a gate) until the refreshes are done."""
    tc = service.create_lora_training_client(base_model=BASE, rank=4).result()
    old = tc.save_weights_and_get_sampling_client().result()
    backend_id = server.door.samplers[old._sampling_session_id].backend_id
    entered, gate = threading.Event(), threading.Event()
    real = server.backend.sample

    async def held(sampler_id: str, request: Any) -> Any:
        if sampler_id == backend_id:
            entered.set()
            await anyio.to_thread.run_sync(gate.wait)
        return await real(sampler_id, request)

    monkeypatch.setattr(server.backend, "sample", held)
    try:
        pending = old.sample(PROMPT, 1, PARAMS)
        assert entered.wait(60), "the sample never reached the backend"
        for _ in range(CAP + 2):
            tc.save_weights_and_get_sampling_client().result()
        assert server.door.samplers[old._sampling_session_id].backend_id == backend_id
    finally:
        gate.set()
    assert len(pending.result().sequences[0].tokens) == 3
    tc.save_weights_and_get_sampling_client().result()  # now idle and the least recently used: released
    with pytest.raises(tinker.APIStatusError) as err:
        old.sample(PROMPT, 1, PARAMS).result()
    assert err.value.status_code == 410


def test_a_closed_sampler_whose_checkpoint_was_deleted_is_a_410(server: Server, service: tinker.ServiceClient) -> None:
    tc = service.create_lora_training_client(base_model=BASE, rank=4).result()
    path = tc.save_weights_for_sampler("gone").result().path
    sampler = service.create_sampling_client(model_path=path).result()
    for _ in range(CAP):
        service.create_sampling_client(base_model=BASE).result()  # each opens one: the path's sampler is closed
    assert server.door.samplers[sampler._sampling_session_id].backend_id is None
    tinker.RestClient(base_url=server.url, api_key=API_KEY).delete_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.APIStatusError) as err:
        sampler.sample(PROMPT, 1, PARAMS).result()
    assert err.value.status_code == 410 and "gone" in err.value.body["error"]  # type: ignore[index]


def test_the_openai_door_reopens_a_closed_sampler_and_says_why_a_released_one_is_gone(
    server: Server, service: tinker.ServiceClient
) -> None:
    """The OpenAI front serves the Tinker door's samplers by id: one the door closed reopens on its next call
    (same answer), one it released is a 410 ``model_gone`` that says why."""
    import openai

    chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    hi = [{"role": "user", "content": "Say hi."}]
    tc = service.create_lora_training_client(base_model=BASE, rank=4).result()
    on_base = service.create_sampling_client(base_model=BASE).result()._sampling_session_id
    ephemeral = tc.save_weights_and_get_sampling_client().result()._sampling_session_id
    before = chat.chat.completions.create(model=on_base, messages=hi, max_tokens=4, seed=3)  # type: ignore[arg-type]
    chat.chat.completions.create(model=ephemeral, messages=hi, max_tokens=4, seed=3)  # type: ignore[arg-type]
    for _ in range(CAP):
        tc.save_weights_and_get_sampling_client().result()
    assert server.door.samplers[on_base].backend_id is None and ephemeral not in server.door.samplers
    after = chat.chat.completions.create(model=on_base, messages=hi, max_tokens=4, seed=3)  # type: ignore[arg-type]
    assert after.choices[0].message.content == before.choices[0].message.content
    with pytest.raises(openai.APIStatusError) as err:
        chat.chat.completions.create(model=ephemeral, messages=hi, max_tokens=4)  # type: ignore[arg-type]
    assert err.value.status_code == 410 and "released" in str(err.value)
