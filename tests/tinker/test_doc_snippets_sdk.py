"""Tinker's published tutorials, run verbatim through the official ``tinker`` SDK against ``asyncsess serve`` on
mock:// (only the model name changed; the server comes from ``TINKER_BASE_URL``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import tinker
import torch

from .conftest import API_KEY, Server, start_server

pytestmark = pytest.mark.tinker

OTHER_KEY = "tml-asyncsess-docs-other"


@pytest.fixture(scope="module")
def shared() -> Iterator[Server]:
    """One server, two tenants."""
    yield from start_server("mock://", api_keys={API_KEY, OTHER_KEY})


def test_weights_tutorial_lists_a_runs_checkpoints_by_its_run_id(shared: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """tinker-cookbook ``tutorials/204_weights.py``: ``run_id = model_id.split(":")[0]`` ("model_id format:
    <run_id>:train:<seq>"), then ``rest_client.list_checkpoints(run_id)``. The door knew only model ids, so the
    tutorial's listing was a 404; a session id of the caller's now lists its runs' checkpoints, and is a 404 to
    another key as before."""
    monkeypatch.setenv("TINKER_BASE_URL", shared.url)

    async def cells() -> tuple[str, str, list[str]]:
        service_client = tinker.ServiceClient()
        training_client = await service_client.create_lora_training_client(base_model="mock/bigram-tiny", rank=16)
        datum = tinker.Datum(
            model_input=tinker.ModelInput.from_ints([5, 6, 7, 8]),
            loss_fn_inputs={
                "target_tokens": tinker.TensorData.from_torch(torch.tensor([6, 7, 8, 9])),
                "weights": tinker.TensorData.from_torch(torch.tensor([1.0] * 4)),
            },
        )
        await training_client.forward_backward([datum], loss_fn="cross_entropy")
        sampler_path = (await training_client.save_weights_for_sampler("tutorial-sampler")).path
        await training_client.save_state("tutorial-state")
        rest_client = service_client.create_rest_client()
        _info = await training_client.get_info_async()
        run_id = _info.model_id.split(":")[0]
        checkpoints_response = rest_client.list_checkpoints(run_id).result()
        listed = [f"[{cp.checkpoint_type}] {cp.checkpoint_id}" for cp in checkpoints_response.checkpoints]
        by_model = rest_client.list_checkpoints(_info.model_id).result()  # the model id still works
        assert [cp.checkpoint_id for cp in by_model.checkpoints] == [cp.checkpoint_id for cp in checkpoints_response.checkpoints]
        service_client.holder.close()
        return run_id, sampler_path, listed

    run_id, sampler_path, listed = asyncio.run(cells())
    assert sampler_path.startswith(f"tinker://{run_id}:train:")
    assert sorted(listed) == ["[sampler] sampler_weights/tutorial-sampler", "[training] weights/tutorial-state"]
    stranger = tinker.RestClient(base_url=shared.url, api_key=OTHER_KEY)
    with pytest.raises(tinker.NotFoundError, match="model_id"):
        stranger.list_checkpoints(run_id).result()
