"""Checkpoint directories on disk as a careless user, a full disk or an attacker leaves them: each is a typed
error (a 4xx) before an adapter is allocated or a tensor read, never a crash, an OOM or a 5xx, and the worker
stays usable."""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402

from asyncsess.backends import SamplerSpec, TrainingSessionSpec  # noqa: E402
from asyncsess.errors import InvalidInputError  # noqa: E402
from asyncsess.types import AdamParams  # noqa: E402

from .helpers import Ops, sft_datum  # noqa: E402

pytestmark = [pytest.mark.local, pytest.mark.anyio]


def _path(uri: str) -> Path:
    return Path(uri[len("local://") :])


def _meta(key: str, value: object) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        meta = json.loads((d / "asyncsess.json").read_text())
        meta[key] = value
        (d / "asyncsess.json").write_text(json.dumps(meta))

    return edit


def _load(file: Path) -> dict:
    """The tensors of ``file``, copied out of its memory map (the file is rewritten next)."""
    return {k: v.clone() for k, v in load_file(str(file)).items()}


def _tensors(file: str, change: Callable[[dict], dict]) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        save_file(change(_load(d / file)), str(d / file))

    return edit


def _header(file: str, change: Callable[[dict], None]) -> Callable[[Path], None]:
    """Rewrite a safetensors header in place (the data stays as it was)."""

    def edit(d: Path) -> None:
        raw = (d / file).read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8 : 8 + n])
        change(header)
        new = json.dumps(header).encode()
        (d / file).write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])

    return edit


def _first(header: dict) -> dict:
    return header[next(k for k in header if k != "__metadata__")]


def _write(file: str, data: bytes) -> Callable[[Path], None]:
    return lambda d: (d / file).write_bytes(data)


def _truncate(file: str) -> Callable[[Path], None]:
    return lambda d: os.truncate(d / file, (d / file).stat().st_size // 2)


def _pickle(file: str) -> Callable[[Path], None]:
    return lambda d: torch.save(_load(d / file), str(d / file))


def _link_out(file: str) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        outside = d.parents[3] / f"outside-{file}"
        shutil.copy(d / file, outside)
        (d / file).unlink()
        (d / file).symlink_to(outside)

    return edit


STATE = {
    "rank 10**9": _meta("rank", 10**9),
    "negative rank": _meta("rank", -2),
    "float rank": _meta("rank", 2.5),
    "rank as bool": _meta("rank", True),
    "alpha NaN": _meta("alpha", float("nan")),
    "unknown target": _meta("targets", ["no_such_proj"]),
    "targets as string": _meta("targets", "q_proj"),
    "step as string": _meta("step", "3"),
    "meta not JSON": _write("asyncsess.json", b'{"kind": "state", "ra'),
    "meta a list": _write("asyncsess.json", b"[]"),
    "1 TB tensor": _header("adapter.safetensors", lambda h: _first(h).update(shape=[2**20, 2**20])),
    "offsets past the end": _header("adapter.safetensors", lambda h: _first(h).update(data_offsets=[0, 2**40])),
    "header claims 2**63 bytes": lambda d: (d / "adapter.safetensors").write_bytes(struct.pack("<Q", 2**63) + b"{}"),
    "truncated weights": _truncate("adapter.safetensors"),
    "empty weights": _write("adapter.safetensors", b""),
    "pickle weights": _pickle("adapter.safetensors"),
    "wrong shape": _tensors("adapter.safetensors", lambda ts: {k: torch.zeros(*v.shape[:-1], v.shape[-1] + 1) for k, v in ts.items()}),
    "int dtype": _tensors("adapter.safetensors", lambda ts: {k: v.to(torch.int64) for k, v in ts.items()}),
    "missing tensor": _tensors("adapter.safetensors", lambda ts: dict(list(ts.items())[1:])),
    "extra tensor": _tensors("adapter.safetensors", lambda ts: {**ts, "evil": torch.zeros(1)}),
    "NaN weights": _tensors("adapter.safetensors", lambda ts: {k: v * float("nan") for k, v in ts.items()}),
    "inf optimizer moment": _tensors(
        "optimizer.safetensors", lambda ts: {k: v * float("inf") if "exp_avg" in k else v for k, v in ts.items()}
    ),
    "optimizer of another shape": _tensors(
        "optimizer.safetensors", lambda ts: {k: torch.zeros(3) if "exp_avg" in k else v for k, v in ts.items()}
    ),
    "weights linked out of the root": _link_out("adapter.safetensors"),
    "meta linked out of the root": _link_out("asyncsess.json"),
}

SAMPLER = {
    "r = 10**9": lambda d: _config(d, r=10**9),
    "negative r": lambda d: _config(d, r=-1),
    "float r": lambda d: _config(d, r=4.0),
    "unknown target module": lambda d: _config(d, target_modules=["no_such_proj"]),
    "config not JSON": _write("adapter_config.json", b"{"),
    "1 TB tensor": _header("adapter_model.safetensors", lambda h: _first(h).update(shape=[2**20, 2**20])),
    "truncated": _truncate("adapter_model.safetensors"),
    "pickle": _pickle("adapter_model.safetensors"),
    "NaN": _tensors("adapter_model.safetensors", lambda ts: {k: v * float("nan") for k, v in ts.items()}),
    "config linked out of the root": _link_out("adapter_config.json"),
    "step as string": _meta("step", "3"),  # the step a capture reports as the weights' version
    "negative step": _meta("step", -1),
}


def _config(d: Path, **change: object) -> None:
    config = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**config, **change}))


@pytest.fixture
async def saved(backend_factory, tiny):
    """A backend with a trained session's state (``state``) and sampler (``sampler``) checkpoints."""
    b = backend_factory()
    await b.open()
    try:
        ops = Ops()
        info = await b.create_training_session(TrainingSessionSpec(base_model=tiny, rank=2, seed=0))
        data = sft_datum(b.get_tokenizer(tiny).encode("what is 2 plus 3? the answer is 5."))
        await b.execute_training(info.model_id, ops("forward_backward", data=(data,), loss_fn="cross_entropy"))
        await b.execute_training(info.model_id, ops("optim_step", adam_params=AdamParams(learning_rate=1e-2)))
        state = await b.execute_training(info.model_id, ops("save_state", name="s"))
        sampler = await b.execute_training(info.model_id, ops("save_weights", name="w"))
        yield b, _path(state.path), _path(sampler.path)
    finally:
        await b.aclose()


def _tampered(src: Path, name: str, edit: Callable[[Path], None]) -> str:
    d = src.parent / name
    shutil.copytree(src, d)
    edit(d)
    return f"local://{d}"


@pytest.mark.parametrize("case", list(STATE))
async def test_a_tampered_state_checkpoint_is_refused_before_it_is_loaded(saved, tiny, case):
    b, state, _ = saved
    path = _tampered(state, "bad", STATE[case])
    sessions = set(b.engine.sessions)
    with pytest.raises(InvalidInputError) as err:
        await b.create_training_session(TrainingSessionSpec(base_model=tiny, from_path=path, with_optimizer=True))
    assert err.value.status_code == 400 and err.value.field == "from_path"
    if "optimizer" not in case:  # a sampler reads the weights only
        with pytest.raises(InvalidInputError):
            await b.create_sampler(SamplerSpec(model_path=path))
    assert set(b.engine.sessions) == sessions
    assert len(await b.list_checkpoints()) >= 2  # the listing survives a damaged directory
    again = await b.create_training_session(TrainingSessionSpec(base_model=tiny, from_path=f"local://{state}"))
    assert again.step == 1  # the worker still loads a good one


@pytest.mark.parametrize("case", list(SAMPLER))
async def test_a_tampered_sampler_checkpoint_is_refused_before_it_is_loaded(saved, case):
    b, _, sampler = saved
    path = _tampered(sampler, "bad", SAMPLER[case])
    with pytest.raises(InvalidInputError) as err:
        await b.create_sampler(SamplerSpec(model_path=path))
    assert err.value.status_code == 400 and err.value.field == "model_path"
    assert await b.create_sampler(SamplerSpec(model_path=f"local://{sampler}"))


@pytest.fixture(scope="module")
def worker(tiny, tmp_path_factory):
    from .server_helpers import start_worker

    w = start_worker(tiny, str(tmp_path_factory.mktemp("files-ckpt")))
    yield w
    w.stop()


@pytest.mark.parametrize("case", ["rank 10**9", "1 TB tensor", "pickle weights", "NaN weights", "weights linked out of the root"])
def test_over_http_a_tampered_checkpoint_is_a_400_naming_the_field(c, tiny, case):
    from .server_helpers import MINE, assert_healthy, assert_refused, new_session, send

    sid = new_session(c, tiny, MINE)
    r = c.post(f"/v1/sessions/{sid}/ops", json={"kind": "save_state", "seq": 1, "idempotency_key": "s-1"}, headers=MINE)
    assert r.status_code == 200, r.text
    path = _tampered(_path(r.json()["result"]["path"]), f"bad-{len(case)}-{sum(map(ord, case))}", STATE[case])
    assert_refused(send(c, "POST", "/v1/sessions", {"base_model": tiny, "from_path": path}, MINE), "from_path")
    assert_refused(send(c, "POST", "/v1/samplers", {"model_path": path}, MINE), "model_path")
    assert_healthy(c, tiny)
