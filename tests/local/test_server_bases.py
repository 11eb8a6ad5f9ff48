"""Two base models on one worker: a checkpoint is only ever loaded onto the base model it was trained on.

A second tiny Llama (another hidden size, or one more layer: the same module names) is allowed with
``models=``; a state saved on the first was loaded onto the second when a client named it (refused only by
the accident of a shape mismatch, with ``field: body`` and the tensor's name, or not at all where the shapes
fit), and a sampler's ``base_model`` next to a ``model_path`` was silently ignored.
"""

from __future__ import annotations

import httpx
import pytest

torch = pytest.importorskip("torch")

from .server_helpers import MINE, assert_refused, new_sampler, new_session, send, start_worker  # noqa: E402

pytestmark = pytest.mark.local


@pytest.fixture(scope="module")
def others(tmp_path_factory):
    from asyncsess_local.testing import build_tiny_llama

    return [
        str(build_tiny_llama(tmp_path_factory.mktemp("narrow"), hidden_size=32)),
        str(build_tiny_llama(tmp_path_factory.mktemp("deep"), num_layers=3)),
    ]


@pytest.fixture(scope="module")
def worker(tiny, others, tmp_path_factory):
    w = start_worker(tiny, str(tmp_path_factory.mktemp("bases-ckpt")), models=others)
    yield w
    w.stop()


@pytest.fixture(scope="module")
def saved(c, tiny):
    sid = new_session(c, tiny, MINE)
    paths = {}
    for seq, kind in enumerate(("save_state", "save_weights"), 1):
        r = c.post(f"/v1/sessions/{sid}/ops", json={"kind": kind, "seq": seq, "idempotency_key": kind}, headers=MINE)
        assert r.status_code == 200, r.text
        paths[kind] = r.json()["result"]["path"]
    return paths


def test_a_session_from_a_checkpoint_is_on_the_checkpoints_base_model(c: httpx.Client, tiny, others, saved):
    for other in others:
        err = assert_refused(send(c, "POST", "/v1/sessions", {"base_model": other, "from_path": saved["save_state"]}, MINE), "base_model")
        assert "trained on" in err["message"], err
    for body in ({"from_path": saved["save_state"]}, {"base_model": tiny, "from_path": saved["save_state"]}):
        r = c.post("/v1/sessions", json=body, headers=MINE)
        assert r.status_code == 200 and r.json()["base_model"] == tiny, r.text


def test_load_state_onto_another_base_is_refused_before_it_runs(c: httpx.Client, worker, others, saved):
    for other in others:
        sid = new_session(c, other, MINE)
        load = {"kind": "load_state", "seq": 1, "idempotency_key": "l", "path": saved["save_state"]}
        err = assert_refused(send(c, "POST", f"/v1/sessions/{sid}/ops", load, MINE), "path")
        assert err.get("void") and "trained on" in err["message"], err
        datum = {"model_input": [5, 6], "loss_fn_inputs": {"target_tokens": [6, 7], "weights": [1.0, 1.0]}}
        op = {"kind": "forward", "seq": 2, "idempotency_key": "f", "loss_fn": "cross_entropy", "data": [datum]}
        r = c.post(f"/v1/sessions/{sid}/ops", json=op, headers=MINE)
        assert r.status_code == 200, r.text  # nothing was loaded and nothing is poisoned


def test_a_samplers_base_model_must_be_its_paths(c: httpx.Client, tiny, others, saved):
    for path in saved.values():
        for other in others:
            err = assert_refused(send(c, "POST", "/v1/samplers", {"model_path": path, "base_model": other}, MINE), "base_model")
            assert "holds weights for" in err["message"], err
        assert new_sampler(c, MINE, model_path=path, base_model=tiny)
        assert new_sampler(c, MINE, model_path=path)
