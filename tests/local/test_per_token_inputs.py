"""Per-token loss inputs on local:// (issue 15): clip bounds given per token, and (N, K) multi-target
cross_entropy / importance_sampling. Each is checked against an identity that needs no hand-typed numbers:
a constant per-token bound is the config's bound; K targets per position are K single-target datums."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from asyncsess.backends import TrainingSessionSpec  # noqa: E402
from asyncsess.errors import InvalidInputError  # noqa: E402
from asyncsess.types import AdamParams, Datum, ModelInput  # noqa: E402

from .helpers import TOL, Ops  # noqa: E402
from .server_helpers import MINE, assert_refused, new_session, send, start_worker  # noqa: E402

pytestmark = [pytest.mark.local, pytest.mark.torch, pytest.mark.anyio]

TEXTS = ["what is 2 plus 3? the answer is 5.", "hello world the cat", "one two three four five six seven"]


async def _session(b, tiny, seed=0):
    info = await b.create_training_session(TrainingSessionSpec(base_model=tiny, rank=4, seed=seed))
    sess = b.engine.sessions[info.model_id]
    with torch.no_grad():  # non-zero B, so every LoRA parameter gets a gradient
        for k, p in sess.params.items():
            if "lora_B" in k:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(k)))
    return info.model_id, sess


def _grads(sess):
    return {k: p.grad.detach().clone() for k, p in sess.params.items()}


def _assert_same_grads(a, b, tol=1e-5):
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=tol * max(1.0, float(b[k].abs().max())), msg=lambda m, k=k: f"{k}: {m}")


async def _rl_data(b, tiny, mid, ops, seed):
    """RL datums whose sampler log-probs straddle the clip bounds of the current weights."""
    tok = b.get_tokenizer(tiny)
    rng = np.random.default_rng(seed)
    plain = []
    for t in TEXTS:
        ids = tok.encode(t)
        plain.append(
            Datum(model_input=ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
        )
    now = await b.execute_training(mid, ops("forward", data=tuple(plain), loss_fn="cross_entropy"))
    out = []
    for d, lp in zip(plain, now.loss_fn_outputs):
        p = np.asarray(lp["logprobs"].data)
        n = len(p)
        out.append(
            {
                "model_input": d.model_input,
                "target_tokens": d.loss_fn_inputs["target_tokens"].data,
                "logprobs": (p + rng.normal(0, 0.4, n)).tolist(),
                "advantages": rng.normal(0, 1, n).tolist(),
                "sequence_ratio_mask": (rng.random(n) > 0.3).astype(float).tolist(),
            }
        )
    return out


def _datums(rows, loss_fn, extra=lambda n: {}):
    keep = ("target_tokens", "logprobs", "advantages") + (("sequence_ratio_mask",) if loss_fn == "gspo" else ())
    return tuple(
        Datum(model_input=r["model_input"], loss_fn_inputs={**{k: r[k] for k in keep}, **extra(len(r["target_tokens"]))}) for r in rows
    )


@pytest.mark.parametrize("loss_fn", ["ppo", "cispo", "gspo"])
async def test_constant_per_token_clip_equals_the_config_clip(backend_factory, tiny, loss_fn):
    b = backend_factory(token_budget=24)  # several micro-batches
    try:
        await b.open()
        lo, hi = 0.85, 1.1
        a_id, a = await _session(b, tiny, seed=3)
        ops_a = Ops()  # one sequence of numbers per session: a repeated seq is a retry, answered from the journal
        rows = await _rl_data(b, tiny, a_id, ops_a, seed=1)
        by_config = await b.execute_training(
            a_id,
            ops_a(
                "forward_backward",
                data=_datums(rows, loss_fn),
                loss_fn=loss_fn,
                loss_fn_config={"clip_low_threshold": lo, "clip_high_threshold": hi},
            ),
        )
        c_id, c = await _session(b, tiny, seed=3)
        per_token = _datums(rows, loss_fn, lambda n: {"clip_low_threshold": [lo] * n, "clip_high_threshold": [hi] * n})
        # the config's own bounds are overridden by the per-token ones
        by_tokens = await b.execute_training(
            c_id,
            Ops()(
                "forward_backward", data=per_token, loss_fn=loss_fn, loss_fn_config={"clip_low_threshold": 0.1, "clip_high_threshold": 9.0}
            ),
        )
        assert by_tokens.metrics["loss:sum"] == pytest.approx(by_config.metrics["loss:sum"], rel=1e-6, abs=1e-6)
        _assert_same_grads(_grads(c), _grads(a), tol=1e-6)

        # and the per-token bounds are really used: loosening them on some tokens changes the gradient
        e_id, e = await _session(b, tiny, seed=3)
        loose = _datums(
            rows,
            loss_fn,
            lambda n: {
                "clip_low_threshold": [lo, 0.0] * (n // 2) + [lo] * (n % 2),
                "clip_high_threshold": [hi, 50.0] * (n // 2) + [hi] * (n % 2),
            },
        )
        await b.execute_training(e_id, Ops()("forward_backward", data=loose, loss_fn=loss_fn))
        diff = max(float((e.params[k].grad - a.params[k].grad).abs().max()) for k in a.params)
        assert diff > 1e-4
    finally:
        await b.aclose()


def _multi_rows(tok, k, seed):
    """Datums with K targets per position: random candidate tokens, real-valued weights / advantages."""
    rng = np.random.default_rng(seed)
    out = []
    for t in TEXTS:
        ids = tok.encode(t)[:-1]
        n = len(ids)
        out.append(
            {
                "ids": ids,
                "targets": rng.integers(0, 300, (n, k)),
                "weights": rng.normal(0.5, 1.0, (n, k)) * (rng.random((n, k)) > 0.2),
                "logprobs": -rng.exponential(3.0, (n, k)),
                "advantages": rng.normal(0, 1, (n, k)),
            }
        )
    return out


def _multi_datum(row, loss_fn, col=None):
    keys = ("weights",) if loss_fn == "cross_entropy" else ("logprobs", "advantages", "weights")
    pick = (lambda a: a.tolist()) if col is None else (lambda a: a[:, col].tolist())
    return Datum(
        model_input=ModelInput.from_ints(row["ids"]),
        loss_fn_inputs={"target_tokens": pick(row["targets"]), **{key: pick(row[key]) for key in keys}},
    )


@pytest.mark.parametrize(("loss_fn", "k"), [("cross_entropy", 1), ("cross_entropy", 3), ("importance_sampling", 3)])
async def test_multi_target_equals_one_datum_per_target(backend_factory, tiny, loss_fn, k):
    """(N, K) targets give the loss, log-probs, gradient and updated weights of K single-target datums."""
    b = backend_factory(token_budget=32)
    try:
        await b.open()
        rows = _multi_rows(b.get_tokenizer(tiny), k, seed=k)
        single = _multi_datum(rows[0], loss_fn, col=0)  # an (N,) datum in the same pass as the (N, K) ones
        m_id, m = await _session(b, tiny, seed=5)
        ops_m = Ops()
        multi = await b.execute_training(
            m_id, ops_m("forward_backward", data=(single, *[_multi_datum(r, loss_fn) for r in rows]), loss_fn=loss_fn)
        )
        s_id, s = await _session(b, tiny, seed=5)
        ops_s = Ops()
        spelled = (single, *[_multi_datum(r, loss_fn, col=j) for r in rows for j in range(k)])
        ref = await b.execute_training(s_id, ops_s("forward_backward", data=spelled, loss_fn=loss_fn))

        assert multi.metrics["loss:sum"] == pytest.approx(ref.metrics["loss:sum"], rel=1e-5, abs=1e-5)
        out = [o["logprobs"] for o in multi.loss_fn_outputs]
        assert out[0].shape == [len(rows[0]["ids"])]
        for i, r in enumerate(rows):
            got = np.asarray(out[i + 1].data).reshape(out[i + 1].shape)
            assert list(got.shape) == [len(r["ids"]), k]
            for j in range(k):
                want = ref.loss_fn_outputs[1 + i * k + j]["logprobs"].data
                np.testing.assert_allclose(got[:, j], want, atol=TOL)
        _assert_same_grads(_grads(m), _grads(s))

        adam = AdamParams(learning_rate=1e-2)
        await b.execute_training(m_id, ops_m("optim_step", adam_params=adam))
        await b.execute_training(s_id, ops_s("optim_step", adam_params=adam))
        for key in m.params:
            torch.testing.assert_close(m.params[key].detach(), s.params[key].detach(), rtol=1e-4, atol=TOL)
    finally:
        await b.aclose()


async def test_bad_multi_target_shapes_are_refused_naming_the_field(backend_factory, tiny):
    b = backend_factory()
    try:
        await b.open()
        caps = await b.capabilities()
        assert sorted(caps.multi_target_losses) == ["cross_entropy", "importance_sampling"]
        ids = [5, 6, 7]
        two = [[1, 2], [3, 4], [5, 6]]
        cases = [
            # ppo has one target per position
            ("ppo", {"target_tokens": two, "logprobs": [[-1.0] * 2] * 3, "advantages": [[1.0] * 2] * 3}, "target_tokens"),
            # weights must have the targets' shape
            ("cross_entropy", {"target_tokens": two, "weights": [1.0, 1.0, 1.0]}, "weights"),
            ("importance_sampling", {"target_tokens": two, "logprobs": [[-1.0] * 2] * 3, "advantages": [[1.0] * 3] * 3}, "advantages"),
            # K targets for the wrong number of positions
            ("cross_entropy", {"target_tokens": [[1, 2]] * 2, "weights": [[1.0] * 2] * 2}, "target_tokens"),
            ("cross_entropy", {"target_tokens": [[1, 99999]] * 3, "weights": [[1.0] * 2] * 3}, "data[0]"),
        ]
        for loss_fn, lfi, field in cases:
            d = Datum(model_input=ModelInput.from_ints(ids), loss_fn_inputs=lfi)
            mid, _ = await _session(b, tiny)
            with pytest.raises(InvalidInputError) as err:
                await b.execute_training(mid, Ops()("forward_backward", data=(d,), loss_fn=loss_fn))
            assert field in (err.value.field or ""), (loss_fn, err.value)
    finally:
        await b.aclose()


def test_bad_multi_target_shapes_get_a_400_over_http(tiny, tmp_path):
    import httpx

    w = start_worker(tiny, str(tmp_path / "ckpt"))
    try:
        with httpx.Client(base_url=w.url, timeout=120) as c:
            sid = new_session(c, tiny, MINE)
            op = {
                "kind": "forward_backward",
                "seq": 1,
                "idempotency_key": "k1",
                "loss_fn": "cross_entropy",
                "data": [
                    {
                        "model_input": [5, 6, 7],
                        "loss_fn_inputs": {
                            "target_tokens": {"data": [1, 2, 3, 4, 5, 6], "dtype": "int64", "shape": [3, 2]},
                            "weights": [1.0, 1.0, 1.0],
                        },
                    }
                ],
            }
            err = assert_refused(send(c, "POST", f"/v1/sessions/{sid}/ops", op, MINE), "data[0].loss_fn_inputs['weights']")
            assert err["void"] is True  # the refusal used up seq 1; the next op runs
            op["data"][0]["loss_fn_inputs"]["weights"] = {"data": [1.0] * 6, "dtype": "float32", "shape": [3, 2]}
            r = send(c, "POST", f"/v1/sessions/{sid}/ops", {**op, "seq": 2, "idempotency_key": "k2"}, MINE)
            assert r.status_code == 200, r.text
            assert r.json()["result"]["loss_fn_outputs"][0]["logprobs"]["shape"] == [3, 2]
    finally:
        w.stop()


async def test_csr_n_by_k_targets_train_through_the_client(tiny):
    """The client (and so the Tinker door, which calls it) sends (N, K) targets to local://, CSR or dense alike."""
    from urllib.parse import quote

    from asyncsess import ServiceClient, TensorData

    from .helpers import DEVICE_QUERY

    crow, col = [0, 2, 3, 3, 6], [0, 2, 1, 0, 1, 2]
    sparse = {"shape": [4, 3], "sparse_crow_indices": crow, "sparse_col_indices": col}
    dense_t = [40, 0, 7, 0, 41, 0, 0, 0, 0, 42, 9, 11]
    dense_w = [1.0, 0.0, 0.5, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.25, 2.0]
    results = []
    async with ServiceClient(f"local://?model={quote(tiny)}&{DEVICE_QUERY}") as svc:
        for lfi in (
            {
                "target_tokens": {"data": [40, 7, 41, 42, 9, 11], "dtype": "int64", **sparse},
                "weights": {"data": [1.0, 0.5, 1.0, 1.0, 0.25, 2.0], "dtype": "float32", **sparse},
            },
            {
                "target_tokens": TensorData(data=dense_t, dtype="int64", shape=[4, 3]),
                "weights": TensorData(data=dense_w, dtype="float32", shape=[4, 3]),
            },
        ):
            tc = await svc.create_lora_training_client(tiny, rank=4, seed=7)
            out = await tc.forward_backward([{"model_input": [1, 40, 41, 42], "loss_fn_inputs": lfi}], "cross_entropy")
            results.append((out.loss, out.loss_fn_outputs[0]["logprobs"].data, out.loss_fn_outputs[0]["logprobs"].shape))
            await tc.stop()
    assert results[0] == results[1] and results[0][2] == [4, 3]
    lp = np.asarray(results[0][1]).reshape(4, 3)
    assert results[0][0] == pytest.approx(-(lp * np.asarray(dense_w).reshape(4, 3)).sum(), rel=1e-5)
