"""The official ``tinker`` SDK (pinned 0.38.0) drives ``asyncsess serve`` on mock://, as a user would."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from .conftest import API_KEY, Server

pytestmark = pytest.mark.tinker

BASE = "mock/bigram-tiny"


def _datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    n = len(tokens) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights or [1.0] * n},
    )


BATCH = [_datum([5, 6, 7, 8, 9, 10]), _datum([11, 12, 13, 14]), _datum([20, 21, 22, 23, 24, 25, 26])]


@pytest.fixture(scope="module")
def service(mock_server: Server):
    sc = tinker.ServiceClient(base_url=mock_server.url, api_key=API_KEY)
    yield sc
    sc.holder.close()


def _backend_id(server: Server, tc: tinker.TrainingClient) -> str:
    return server.door.models[tc.model_id].backend_id


def test_supervised_loop_loss_falls(service: tinker.ServiceClient) -> None:
    tc = service.create_lora_training_client(base_model=BASE, rank=8).result()
    losses = []
    for _ in range(8):
        fb = tc.forward_backward(BATCH, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=5e-2))
        out = fb.result()
        opt.result()
        losses.append(out.metrics["loss:sum"])
        assert len(out.loss_fn_outputs) == len(BATCH)
        assert [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs] == [5, 3, 6]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.9 * losses[0], losses
    # forward-only runs the same model without changing it
    f1 = tc.forward(BATCH, "cross_entropy").result()
    f2 = tc.forward(BATCH, "cross_entropy").result()
    assert f1.metrics["loss:sum"] == f2.metrics["loss:sum"]


def test_rl_loop_sampling_and_sampler_refresh(service: tinker.ServiceClient) -> None:
    """GRPO-shaped: sample a group, reward token 42, importance_sampling update, refresh the sampler."""
    tc = service.create_lora_training_client(base_model=BASE, rank=8, seed=1).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([5, 6, 7])
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=0)

    def rewarded_logprob(sc: tinker.SamplingClient) -> float:
        lp = sc.compute_logprobs(types.ModelInput.from_ints([5, 6, 7, 42])).result()
        assert lp[0] is None and len(lp) == 4
        return float(lp[-1])

    before = rewarded_logprob(sampler)
    seen = [before]
    for _ in range(4):
        res = sampler.sample(prompt, num_samples=8, sampling_params=params).result()
        assert len(res.sequences) == 8
        rewards = np.array([s.tokens.count(42) + 1.0 * (s.tokens[0] == 42) for s in res.sequences], dtype=float)
        adv = rewards - rewards.mean()
        data = []
        for s, a in zip(res.sequences, adv):
            assert s.logprobs is not None and len(s.logprobs) == len(s.tokens)
            toks = [5, 6, 7, *s.tokens]
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(toks[:-1]),
                    loss_fn_inputs={
                        "target_tokens": toks[1:],
                        "logprobs": [0.0, 0.0, *s.logprobs],
                        "advantages": [0.0, 0.0] + [float(a)] * len(s.tokens),
                    },
                )
            )
        # also push the rewarded token directly so the direction is certain on a tiny batch
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints([5, 6, 7]),
                loss_fn_inputs={"target_tokens": [6, 7, 42], "logprobs": [0.0, 0.0, -5.0], "advantages": [0.0, 0.0, 1.0]},
            )
        )
        fb = tc.forward_backward(data, "importance_sampling")
        tc.optim_step(types.AdamParams(learning_rate=1e-1)).result()
        assert "loss:sum" in fb.result().metrics
        sampler = tc.save_weights_and_get_sampling_client().result()  # refresh: the next round samples the new weights
        seen.append(rewarded_logprob(sampler))
    assert all(b > a for a, b in zip(seen, seen[1:])), seen  # every refresh serves the newer weights
    after = seen[-1]
    assert after > before + 0.5, seen
    # a named sampler checkpoint opens through create_sampling_client(model_path)
    path = tc.save_weights_for_sampler("rl-final").result().path
    assert path.startswith("tinker://") and path.endswith("/sampler_weights/rl-final")
    again = service.create_sampling_client(model_path=path)
    assert rewarded_logprob(again) == pytest.approx(after, abs=1e-6)


def test_save_and_load_with_optimizer_bit_exact(service: tinker.ServiceClient, mock_server: Server) -> None:
    backend = mock_server.backend
    tc = service.create_lora_training_client(base_model=BASE, rank=8).result()
    for _ in range(3):
        tc.forward_backward(BATCH, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("three-steps").result().path
    assert path == f"tinker://{tc.model_id}/weights/three-steps"

    with_opt = service.create_training_client_from_state_with_optimizer(path).result()
    weights_only = service.create_training_client_from_state(path).result()
    a, b, c = (_backend_id(mock_server, x) for x in (tc, with_opt, weights_only))
    assert np.array_equal(backend.weights(a), backend.weights(b))
    assert np.array_equal(backend.weights(a), backend.weights(c))
    (m1, v1, s1), (m2, v2, s2), (m3, v3, s3) = (backend.optimizer_state(x) for x in (a, b, c))
    assert s1 == s2 == 3 and np.array_equal(m1, m2) and np.array_equal(v1, v2)
    assert s3 == 0 and not m3.any()

    # the next step is the same on the original and on the restored copy, bit for bit
    outs = []
    for client in (tc, with_opt):
        fb = client.forward_backward(BATCH, "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        outs.append(fb.result().metrics["loss:sum"])
    assert outs[0] == outs[1]
    assert np.array_equal(backend.weights(a), backend.weights(b))

    # the legacy load onto an existing model puts the saved state back (step 4 -> 3)
    tc.load_state_with_optimizer(path).result()
    assert backend.optimizer_state(a)[2] == 3
    assert np.array_equal(backend.weights(a), backend.weights(c))
    # the checkpoint is listed over REST
    rest = service.create_rest_client()
    ids = [ck.checkpoint_id for ck in rest.list_checkpoints(tc.model_id).result().checkpoints]
    assert "weights/three-steps" in ids
    run = rest.get_training_run(tc.model_id).result()
    assert run.base_model == BASE and run.lora_rank == 8


def test_futures_awaited_out_of_order(service: tinker.ServiceClient) -> None:
    tc = service.create_lora_training_client(base_model=BASE, rank=8).result()
    futs = []
    for _ in range(3):
        futs.append(tc.forward_backward(BATCH, "cross_entropy"))
        futs.append(tc.optim_step(types.AdamParams(learning_rate=5e-2)))
    results = [f.result() for f in reversed(futs)][::-1]
    losses = [r.metrics["loss:sum"] for r in results[0::2]]
    assert losses[0] > losses[1] > losses[2]  # each fwd/bwd saw the previous optim step: order kept
    assert all(isinstance(r, types.OptimStepResponse) for r in results[1::2])


def test_bad_input_and_unknown_ids_raise_sdk_exceptions(service: tinker.ServiceClient, mock_server: Server) -> None:
    tc = service.create_lora_training_client(base_model=BASE, rank=8).result()
    bad = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]})
    with pytest.raises(tinker.BadRequestError, match=r"does not match the 3 input tokens"):
        tc.forward_backward([bad], "cross_entropy").result()
    huge = _datum([1, 2, 2**31 - 1])
    with pytest.raises(tinker.BadRequestError, match="vocabulary"):
        tc.forward_backward([huge], "cross_entropy").result()
    # the refused requests did not block or poison the model
    assert tc.forward_backward(BATCH, "cross_entropy").result().metrics["loss:sum"] > 0
    with pytest.raises(tinker.NotFoundError, match="path"):
        service.create_training_client_from_state(f"tinker://{tc.model_id}/weights/never-saved").result()
    rest = service.create_rest_client()
    with pytest.raises(tinker.NotFoundError, match="model_id"):
        rest.get_training_run("no-such-run").result()
    tc.save_state("twice").result()
    with pytest.raises(tinker.BadRequestError, match="overwrite"):  # refused before running (was a RequestFailedError)
        tc.save_state("twice").result()
    # a failure while running comes back as the SDK's RequestFailedError with a user category
    too_long = types.Datum(
        model_input=types.ModelInput.from_ints([5] * 600), loss_fn_inputs={"target_tokens": [6] * 600, "weights": [1.0] * 600}
    )
    with pytest.raises(tinker.RequestFailedError) as info:
        tc.forward_backward([too_long], "cross_entropy").result()  # past mock's 512-token context
    assert info.value.category == types.RequestErrorCategory.User
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=mock_server.url, api_key="tml-wrong-key").create_lora_training_client(
            base_model=BASE, rank=8
        ).result()


def test_forward_backward_is_the_same_inline_and_in_worker_threads(
    service: tinker.ServiceClient, mock_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small bodies are decoded, checked and answered on the event loop, big ones in worker threads: both paths
    give bit-identical results, and both refuse a bad token naming the field."""
    tc = service.create_lora_training_client(base_model=BASE, rank=8, seed=3).result()
    assert mock_server.door.inline_bytes > 1000  # these bodies are small: the inline path
    inline = tc.forward(BATCH, "cross_entropy").result()
    monkeypatch.setattr(mock_server.door, "inline_bytes", 0)  # every body to the threads
    threaded = tc.forward(BATCH, "cross_entropy").result()
    assert inline.metrics == threaded.metrics
    assert [o["logprobs"].tolist() for o in inline.loss_fn_outputs] == [o["logprobs"].tolist() for o in threaded.loss_fn_outputs]
    bad = [_datum([5, 6, 10**6])]
    for limit in (0, 10**6):
        monkeypatch.setattr(mock_server.door, "inline_bytes", limit)
        with pytest.raises(tinker.BadRequestError, match=r"data\[0\].*outside the vocabulary"):
            tc.forward(bad, "cross_entropy").result()


def test_search_sessions_pages_and_filters(mock_server: Server) -> None:
    """``RestClient.search_sessions``: the caller's sessions newest first, paged by cursor, filtered by name words,
    user metadata, project and status (a closed client's session is ``client_finished`` / ``success``)."""
    from uuid import uuid4

    tag = uuid4().hex[:10]
    clients = []
    for i in range(3):
        sc = tinker.ServiceClient(
            base_url=mock_server.url,
            api_key=API_KEY,
            display_name=f"Nightly {tag} run{i}",
            user_metadata={"i": str(i)},
            project_id="p-a" if i < 2 else "p-b",
        )
        sc.holder.get_session_id()  # the SDK creates its session in the background; wait for it (fixes the order)
        clients.append(sc)
    try:
        clients[0].close("success").result()
        rest = tinker.RestClient(base_url=mock_server.url, api_key=API_KEY)
        query = types.SessionSearchRequest(display_name=f"{tag.upper()} nightly", limit=2)
        first = rest.search_sessions(query).result()
        assert len(first.sessions) == 2 and first.next_cursor is not None
        rest_of = rest.search_sessions(query.model_copy(update={"cursor": first.next_cursor})).result()
        assert len(rest_of.sessions) == 1 and rest_of.next_cursor is None
        found = first.sessions + rest_of.sessions
        assert [s.display_name for s in found] == [f"Nightly {tag} run{i}" for i in (2, 1, 0)]  # newest first
        assert [s.created_at for s in found] == sorted((s.created_at for s in found), reverse=True)

        def names(**kw) -> list[str | None]:
            page = rest.search_sessions(types.SessionSearchRequest(display_name=tag, **kw)).result()
            return sorted(s.display_name for s in page.sessions)

        assert names(user_metadata={"i": "1"}) == [f"Nightly {tag} run1"]
        assert names(project_ids=["p-b"]) == [f"Nightly {tag} run2"]
        assert names(statuses=[types.ActiveSessionStatusQuery()]) == [f"Nightly {tag} run1", f"Nightly {tag} run2"]
        finished = types.ClientFinishedSessionStatusQuery(reasons=["success"])
        assert names(statuses=[finished]) == [f"Nightly {tag} run0"]
        assert names(statuses=[types.ClientFinishedSessionStatusQuery(reasons=["errored"])]) == []
        # a cursor this server did not write (no time zone) is a 400 naming it (the SDK itself would refuse to send it)
        bad = {"cursor": {"last_created_at": "2020-01-01T00:00:00", "last_session_id": "x"}}
        resp = httpx.post(mock_server.url + "/api/v1/sessions/search", json=bad, headers={"X-API-Key": API_KEY})
        assert resp.status_code == 400 and resp.json()["field"] == "cursor", resp.text
    finally:
        for sc in clients[1:]:
            sc.close("success").result()
