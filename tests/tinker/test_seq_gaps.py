"""A seq_id the official SDK numbered but never sent (its request failed in the client, e.g. a save name it could not
encode) left a hole in the model's queue: the SDK's turn counter moves on and never re-sends it, so every later
request of the model waited the gap timeout for it and failed ("ops N..N never arrived"), for good. Now the queue
goes on without it after the gap timeout, and the seq_id, if it comes after all, is a 400 naming seq_id."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import tinker
from tinker import types

from .conftest import API_KEY, Server, start_server

pytestmark = pytest.mark.tinker

BASE = "mock/bigram-tiny"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    for srv in start_server("mock://"):
        srv.door.gap_timeout = 0.5  # the queue goes on half a second after the hole (requests here are sent one by one)
        yield srv


def test_a_seq_id_the_sdk_never_sent_does_not_stop_the_model(server: Server) -> None:
    service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    try:
        tc = service.create_lora_training_client(base_model=BASE, rank=4).result()
        tc.optim_step(types.AdamParams(learning_rate=0.01)).result()
        with pytest.raises(UnicodeEncodeError):
            tc.save_state("\ud800").result()  # numbered (seq_id 2), then failed in the SDK: never sent
        for _ in range(3):  # every later op runs, in order
            assert tc.optim_step(types.AdamParams(learning_rate=0.01)).result().metrics is not None
        assert tc.save_state("after").result().path.endswith("/weights/after")
        sequencer = server.door.models[tc.model_id].sequencer
        assert sequencer.skipped == {2} and sequencer.applied[-4:] == [3, 4, 5, 6]
        # the hole, sent after all, is refused without effect
        http = httpx.Client(base_url=server.url, headers={"X-API-Key": API_KEY})
        late = http.post("/api/v1/save_weights", json={"model_id": tc.model_id, "seq_id": 2, "path": "late"})
        assert late.status_code == 400 and late.json()["field"] == "seq_id" and "without it" in late.json()["error"]
        rest = tinker.RestClient(base_url=server.url, api_key=API_KEY)
        names = [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
        assert names == ["weights/after"]
    finally:
        service.holder.close()
