"""The official ``tinker`` SDK (pinned 0.38.0) drives ``asyncsess serve`` on mock://, as a user would."""

from __future__ import annotations

import asyncio

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
    sampler = service.create_sampling_client(base_model=BASE)
    with pytest.raises(tinker.RequestFailedError, match="no room in the 512-token context") as info:
        sampler.sample(types.ModelInput.from_ints([5] * 512), 1, types.SamplingParams(max_tokens=3)).result()
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


def test_multi_target_cross_entropy_keeps_its_shape(service: tinker.ServiceClient) -> None:
    """Tinker's ``cross_entropy`` takes ``(N, K)`` targets and weights (mock:// does too); the door refused them
    (checked as one target per position) and sent every output flat, so an ``(N, K)`` log-prob tensor came back as
    ``(N*K,)``."""
    tc = service.create_lora_training_client(base_model=BASE, rank=8, seed=4).result()
    targets = np.array([[6, 9], [7, 10], [8, 11]])
    weights = np.array([[1.0, 0.5], [1.0, 0.25], [0.0, 2.0]], dtype=np.float32)
    multi = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(targets), "weights": types.TensorData.from_numpy(weights)},
    )
    out = tc.forward([multi, BATCH[1]], "cross_entropy").result()
    lp = out.loss_fn_outputs[0]["logprobs"]
    assert lp.shape == [3, 2] and lp.to_numpy().shape == (3, 2)
    assert out.loss_fn_outputs[1]["logprobs"].shape == [3]  # a one-target datum next to it keeps its own shape
    columns = []
    for k in range(2):
        single = types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7]),
            loss_fn_inputs={"target_tokens": targets[:, k].tolist(), "weights": [1.0] * 3},
        )
        columns.append(tc.forward([single], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy())
    assert np.array_equal(lp.to_numpy(), np.stack(columns, axis=1))
    one = out.metrics["loss:sum"] - tc.forward([BATCH[1]], "cross_entropy").result().metrics["loss:sum"]
    assert one == pytest.approx(-float((weights * lp.to_numpy()).sum()), rel=1e-5)


def test_save_state_overwrite_ttl_and_metadata(service: tinker.ServiceClient, mock_server: Server) -> None:
    """``save_state(name, ttl_seconds, overwrite, user_metadata)``: the door dropped all three. A second save of a
    name failed when run even with ``overwrite=True``, and that failure failed every later op of the model; a TTL
    and metadata given at save time were not listed."""
    rest = tinker.RestClient(base_url=mock_server.url, api_key=API_KEY)
    tc = service.create_lora_training_client(base_model=BASE, rank=8, seed=5).result()

    def step_and_loss() -> float:
        tc.forward_backward(BATCH, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        return tc.forward(BATCH, "cross_entropy").result().metrics["loss:sum"]

    def loss_at(path: str) -> float:
        return service.create_training_client_from_state(path).result().forward(BATCH, "cross_entropy").result().metrics["loss:sum"]

    def listed(cid: str) -> types.Checkpoint:
        return next(c for c in rest.list_checkpoints(tc.model_id).result().checkpoints if c.checkpoint_id == cid)

    first = step_and_loss()
    path = tc.save_state("x", ttl_seconds=7200, user_metadata={"step": "1"}).result().path
    ck = listed("weights/x")
    assert ck.user_metadata == {"step": "1"} and ck.expires_at is not None
    assert (ck.expires_at - ck.time).total_seconds() == pytest.approx(7200, abs=2)

    second = step_and_loss()
    with pytest.raises(tinker.BadRequestError, match="overwrite=True"):
        tc.save_state("x").result()
    assert tc.forward(BATCH, "cross_entropy").result().metrics["loss:sum"] == second  # the model goes on
    assert loss_at(path) == first  # the checkpoint is untouched

    assert tc.save_state("x", overwrite=True).result().path == path
    assert loss_at(path) == second
    ck = listed("weights/x")
    assert ck.user_metadata is None and ck.expires_at is None  # an overwrite replaces metadata and TTL
    assert [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == ["weights/x"]

    sampler = tc.save_weights_for_sampler("s", ttl_seconds=3600, user_metadata={"kind": "eval"}).result().path
    assert listed("sampler_weights/s").user_metadata == {"kind": "eval"}
    with pytest.raises(tinker.BadRequestError, match="already saved sampler_weights/s"):
        tc.save_weights_for_sampler("s").result()
    rest.delete_checkpoint_from_tinker_path(sampler).result()
    assert tc.save_weights_for_sampler("s").result().path == sampler  # a deleted name can be saved again
    assert tc.forward(BATCH, "cross_entropy").result().metrics["loss:sum"] == second


def test_a_deleted_checkpoint_is_deleted_on_the_backend(service: tinker.ServiceClient, mock_server: Server) -> None:
    """The cookbook's rolling checkpoints save the state every step and delete the previous one to bound storage;
    the door only forgot its record, so every deleted checkpoint stayed on the backend (on local://, on disk)."""
    rest = tinker.RestClient(base_url=mock_server.url, api_key=API_KEY)
    tc = service.create_lora_training_client(base_model=BASE, rank=8).result()
    backend_id = mock_server.door.models[tc.model_id].backend_id

    def on_backend() -> list[str]:
        return sorted(c.checkpoint_id for c in asyncio.run(mock_server.backend.list_checkpoints(backend_id)))

    first = tc.save_state("rolling-1").result().path
    tc.save_state("rolling-2").result()
    sampler = tc.save_weights_for_sampler("rolling-2").result().path
    assert len(on_backend()) == 3
    raw = mock_server.door.checkpoints[first].backend_path
    rest.delete_checkpoint_from_tinker_path(first).result()
    rest.delete_checkpoint_from_tinker_path(sampler).result()
    assert len(on_backend()) == 1
    with pytest.raises(tinker.NotFoundError, match="path"):
        service.create_training_client_from_state(raw).result()  # nor loadable by its backend path
    assert [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == ["weights/rolling-2"]


def test_topk_and_target_prompt_logprobs_equal_mock_directly(service: tinker.ServiceClient) -> None:
    """The cookbook's distillation (``topk_prompt_logprobs``) and decision recipes (``target_prompt_logprobs``,
    sparse with ``pad_value=-1``) sample with them; the door refused all of them with a 400, though the backend
    computes them. They now come back as asyncsess's own client gets them from mock:// in process."""
    import torch

    import asyncsess

    prompt = [5, 9, 13, 17, 21]
    ids = np.array([[9, -1], [13, 1], [-1, -1], [21, 22]])

    async def in_process() -> asyncsess.SampleResponse:
        async with asyncsess.ServiceClient("mock://") as svc:
            sc = await svc.create_sampling_client(base_model=BASE)
            params = asyncsess.SamplingParams(max_tokens=3, seed=1)
            return await sc.sample(prompt, 2, params, True, topk_prompt_logprobs=3, topk_sample_logprobs=2, target_prompt_logprobs=ids)

    def same(got: list, want: list) -> bool:
        """Equal top-k rows: the same ids, the log-probs to float32."""
        assert len(got) == len(want)
        for g, w in zip(got, want):
            if (g is None) != (w is None) or (g is not None and [t for t, _ in g] != [t for t, _ in w]):
                return False
            if g is not None and not np.allclose([lp for _, lp in g], [lp for _, lp in w], atol=1e-6):
                return False
        return True

    want = asyncio.run(in_process())
    sampler = service.create_sampling_client(base_model=BASE)
    got = sampler.sample(
        types.ModelInput.from_ints(prompt),
        2,
        types.SamplingParams(max_tokens=3, seed=1),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
        topk_sample_logprobs=2,
        target_prompt_logprobs=types.TensorData.from_torch(torch.from_numpy(ids)),
    ).result()
    assert got.topk_prompt_logprobs[0] is None and got.topk_prompt_logprobs_np.token_ids.shape == (5, 3)
    assert same(got.topk_prompt_logprobs, want.topk_prompt_logprobs)
    for g, w in zip(got.sequences, want.sequences):
        assert g.tokens == w.tokens and len(g.topk_logprobs) == 3 and same(g.topk_logprobs, w.topk_logprobs)
    target = got.target_prompt_logprobs.to_numpy()
    assert target.shape == (4, 2) and np.allclose(target, want.target_prompt_logprobs.to_numpy(), atol=1e-6)
    assert target[0, 0] == pytest.approx(got.prompt_logprobs[1], abs=1e-6) and target[2].tolist() == [0.0, 0.0]

    # a sparse target names only its cells (unlisted ones are skips, not token 0); last_n keeps the last top-k rows
    sparse = types.TensorData.from_torch_sparse(torch.tensor([[-1, -1], [-1, -1], [-1, -1], [21, -1]]), pad_value=-1)
    assert sparse.sparse_crow_indices is not None
    one = sampler.sample(
        types.ModelInput.from_ints(prompt),
        1,
        types.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
        target_prompt_logprobs=sparse,
        prompt_logprobs_last_n=2,
    ).result()
    assert one.target_prompt_logprobs.to_numpy()[:3].tolist() == [[0.0, 0.0]] * 3
    assert one.target_prompt_logprobs.to_numpy()[3].tolist() == [pytest.approx(target[3, 0], abs=1e-6), 0.0]
    assert one.topk_prompt_logprobs[:3] == [None] * 3 and same(one.topk_prompt_logprobs[3:], want.topk_prompt_logprobs[3:])


def test_topk_prompt_logprobs_of_a_1_token_prompt_are_one_unscored_row(service: tinker.ServiceClient) -> None:
    """A 1-token prompt has no scored position: mock:// answers ``[None]`` for its top-k rows, but the door sent
    them 0 columns wide and the SDK read the field as absent (``None``), as if top-k had not been asked for."""
    import asyncsess

    async def in_process() -> asyncsess.SampleResponse:
        async with asyncsess.ServiceClient("mock://") as svc:
            sc = await svc.create_sampling_client(base_model=BASE)
            params = asyncsess.SamplingParams(max_tokens=2, seed=1)
            return await sc.sample([5], 1, params, True, topk_prompt_logprobs=3, topk_sample_logprobs=2)

    want = asyncio.run(in_process())
    got = (
        service.create_sampling_client(base_model=BASE)
        .sample(
            types.ModelInput.from_ints([5]),
            1,
            types.SamplingParams(max_tokens=2, seed=1),
            include_prompt_logprobs=True,
            topk_prompt_logprobs=3,
            topk_sample_logprobs=2,
        )
        .result()
    )
    assert want.prompt_logprobs == want.topk_prompt_logprobs == [None]
    assert got.prompt_logprobs == got.topk_prompt_logprobs == [None]
    assert got.sequences[0].tokens == want.sequences[0].tokens
    assert [[t for t, _ in row] for row in got.sequences[0].topk_logprobs] == [
        [t for t, _ in row] for row in want.sequences[0].topk_logprobs
    ]


def test_get_session_names_it_and_training_runs_filter_by_project(mock_server: Server) -> None:
    """``get_session`` left out the session's display_name, and ``list_training_runs(project_id=...)`` ignored the
    project (every run was listed for any project)."""
    rest = tinker.RestClient(base_url=mock_server.url, api_key=API_KEY)
    with tinker.ServiceClient(base_url=mock_server.url, api_key=API_KEY, display_name="sweep a", project_id="proj-a") as sc:
        tc = sc.create_lora_training_client(base_model=BASE, rank=8).result()
        session_id = tc.model_id.split(":")[0]
        assert rest.get_session(session_id).result().display_name == "sweep a"

        def runs(project: str | None) -> list[str]:
            return [r.training_run_id for r in rest.list_training_runs(limit=100, project_id=project).result().training_runs]

        assert tc.model_id in runs("proj-a") and tc.model_id in runs(None)
        assert tc.model_id not in runs("proj-b")
        rest.assign_session_project(session_id, "proj-b").result()
        assert tc.model_id in runs("proj-b") and tc.model_id not in runs("proj-a")


def test_weights_info_reports_the_lora_targets(service: tinker.ServiceClient, mock_server: Server) -> None:
    """``get_weights_info_by_tinker_path`` said train_mlp/attn/unembed were all True whatever the model was created
    with; a client resumed from the state keeps the flags too."""
    rest = tinker.RestClient(base_url=mock_server.url, api_key=API_KEY)
    tc = service.create_lora_training_client(base_model=BASE, rank=4, train_unembed=False, train_attn=False).result()
    path = tc.save_state("targets").result().path
    info = rest.get_weights_info_by_tinker_path(path).result()
    assert (info.train_mlp, info.train_attn, info.train_unembed, info.lora_rank) == (True, False, False, 4)
    resumed = service.create_training_client_from_state(path).result()
    again = rest.get_weights_info_by_tinker_path(resumed.save_weights_for_sampler("s").result().path).result()
    assert (again.train_mlp, again.train_attn, again.train_unembed) == (True, False, False)


def test_user_checkpoints_are_paged_newest_first(service: tinker.ServiceClient, mock_server: Server) -> None:
    """``list_user_checkpoints(limit, offset)`` answered every checkpoint, oldest first, whatever the page asked."""
    import asyncsess

    rest = tinker.RestClient(base_url=mock_server.url, api_key=API_KEY)
    tc = service.create_lora_training_client(base_model=BASE, rank=4).result()
    for i in range(3):
        tc.save_state(f"page-{i}").result()
    first = rest.list_user_checkpoints(limit=2).result()
    assert [c.checkpoint_id for c in first.checkpoints] == ["weights/page-2", "weights/page-1"]
    assert (first.cursor.offset, first.cursor.limit) == (0, 2) and first.cursor.total_count >= 3
    assert rest.list_user_checkpoints(limit=1, offset=2).result().checkpoints[0].checkpoint_id == "weights/page-0"
    with pytest.raises(tinker.BadRequestError, match="limit"):
        rest.list_user_checkpoints(limit=0).result()

    async def every() -> list[str]:  # asyncsess's client over tinker:// reads every page
        url = mock_server.url.replace("http://", "tinker://") + f"?api_key={API_KEY}"
        async with asyncsess.ServiceClient(url) as svc:
            return [c.path for c in await svc.list_checkpoints()]

    assert len(asyncio.run(every())) == first.cursor.total_count
