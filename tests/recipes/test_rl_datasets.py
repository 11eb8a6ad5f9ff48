"""Stateful RL datasets on mock://: a user's own stream resumes bit for bit (in process, after a lost session,
and after the training process is SIGKILLed); ShuffledDataset; clear errors for states that cannot be saved
or do not fit the run being resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from asyncsess import ServiceClient
from asyncsess.errors import InvalidInputError
from asyncsess.rl import ProblemGroupBuilder, PromptRenderer, RLConfig, ShuffledDataset, problem_datasets, train_rl
from asyncsess.runs.checkpoints import CHECKPOINTS_FILE, last_checkpoint
from asyncsess.runs.metrics import read_metrics

from .helpers import digit_share
from .user_stream import BASE, PROBLEMS, ShuffleBufferStream, drawn, run

ROOT = Path(__file__).resolve().parents[2]


async def state(path: str, url: str = "mock://") -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Weights and AdamW state stored at a mock:// checkpoint path."""
    async with ServiceClient(url) as svc:
        tc = await svc.create_training_client_from_state_with_optimizer(path)
        m, v, step = svc.backend.optimizer_state(tc.model_id)
        return svc.backend.weights(tc.model_id), m, v, step


def comparable(run_dir: Path) -> list[dict]:
    """metrics.jsonl without wall-clock figures (and a recovery's own)."""
    return [
        {k: v for k, v in r.items() if not (k.startswith(("time/", "recovery/")) or k.endswith("_per_s") or k == "progress/done_frac")}
        for r in read_metrics(run_dir)
    ]


def assert_same_state(a: tuple, b: tuple, steps: int) -> None:
    assert a[3] == b[3] == steps
    for x, y in zip(a[:3], b[:3]):
        assert np.array_equal(x, y)


@pytest.mark.anyio
@pytest.mark.parametrize("k", [0, 2])
async def test_a_users_stream_resumes_bit_for_bit(tmp_path, k):
    """Split at step 3 and resumed, or with its session dropped every 17 ops and recovered: the same weights,
    optimizer state, data order and metrics rows as one uninterrupted run."""
    cfg = BASE.model_copy(update={"max_steps": 6, "save_every": 2, "max_staleness": k})
    whole = await run(cfg, tmp_path / "whole")
    first = await run(cfg.model_copy(update={"max_steps": 3}), tmp_path / "split")
    record = last_checkpoint(tmp_path / "split")
    assert first.steps == 3 and record is not None and record.step == 3
    saved = record.extra["dataset"]
    assert saved["type"] == "ShuffleBufferStream" and set(saved["state"]) == {"read", "buffer", "served", "rng"}
    if k:  # groups started but not trained are saved with the state of the first of their batches
        pending = json.loads((tmp_path / "split" / record.extra["pending_file"]).read_text())
        assert pending and saved["batch"] == min(g["index"] for g in pending) // cfg.groups_per_batch < record.extra["cursor"] // 4
    else:
        assert "pending_file" not in record.extra and saved["batch"] == 3 == saved["state"]["served"]
    resumed = await run(cfg, tmp_path / "split")
    flaky = cfg.model_copy(update={"url": "mock://?stop_after_ops=17", "max_recoveries": 10, "recovery_wait_s": 5.0})
    recovered = await run(flaky, tmp_path / "flaky")
    assert any("recovery/count" in r for r in read_metrics(tmp_path / "flaky"))

    reference = await state(whole.final_checkpoint.state_path)
    assert resumed.after == whole.after and resumed.before == whole.before
    for other in (resumed, recovered):
        assert_same_state(reference, await state(other.final_checkpoint.state_path), 6)
    order = drawn(tmp_path / "whole" / "draws.jsonl")
    assert len(order) >= 6 + k and len({tuple(v) for v in order.values()}) > 1
    assert drawn(tmp_path / "split" / "draws.jsonl") == order == drawn(tmp_path / "flaky" / "draws.jsonl")
    assert comparable(tmp_path / "split") == comparable(tmp_path / "whole") == comparable(tmp_path / "flaky")


@pytest.mark.anyio
async def test_shuffled_dataset_drives_a_run_that_resumes_bit_for_bit(tmp_path):
    cfg = BASE.model_copy(update={"max_steps": 4, "save_every": 2, "max_staleness": 1})

    def datasets(tokenizer):
        renderer = PromptRenderer(tokenizer)
        build = lambda p: ProblemGroupBuilder(renderer, p, digit_share, cfg.group_size)  # noqa: E731
        return ShuffledDataset(PROBLEMS[:5], cfg.groups_per_batch, build, seed=cfg.seed), []

    whole = await train_rl(cfg, datasets, tmp_path / "whole", progress=False)
    await train_rl(cfg.model_copy(update={"max_steps": 2}), datasets, tmp_path / "split", progress=False)
    assert set(last_checkpoint(tmp_path / "split").extra["dataset"]["state"]) == {"num_items", "epoch", "position", "rng"}
    resumed = await train_rl(cfg, datasets, tmp_path / "split", progress=False)
    assert_same_state(await state(whole.final_checkpoint.state_path), await state(resumed.final_checkpoint.state_path), 4)
    assert comparable(tmp_path / "split") == comparable(tmp_path / "whole")


def test_shuffled_dataset_epochs_and_state():
    data = ShuffledDataset(list(range(7)), 3, lambda i: i, seed=1)  # type: ignore[arg-type,return-value]
    stream = [x for _ in range(7) for x in data.next_batch()]  # 21 items: three epochs
    epochs = [stream[i : i + 7] for i in range(0, 21, 7)]
    assert all(sorted(e) == list(range(7)) for e in epochs) and len({tuple(e) for e in epochs}) == 3
    again = ShuffledDataset(list(range(7)), 3, lambda i: i, seed=1)  # type: ignore[arg-type,return-value]
    for _ in range(3):
        again.next_batch()
    saved = json.loads(json.dumps(again.state_dict()))  # mid-epoch, through JSON
    later = [again.next_batch() for _ in range(4)]
    fresh = ShuffledDataset(list(range(7)), 3, lambda i: i, seed=99)  # type: ignore[arg-type,return-value]
    fresh.load_state_dict(saved)
    assert [fresh.next_batch() for _ in range(4)] == later == [stream[i : i + 3] for i in range(9, 21, 3)]
    with pytest.raises(InvalidInputError) as err:
        ShuffledDataset(list(range(8)), 3, lambda i: i).load_state_dict(saved)  # type: ignore[arg-type,return-value]
    assert err.value.field == "items"
    for bad in ({"items": []}, {"batch_size": 0}):
        with pytest.raises(InvalidInputError) as err:
            ShuffledDataset(**{"items": [1], "batch_size": 1, "build": lambda i: i, **bad})  # type: ignore[arg-type]
        assert err.value.field == next(iter(bad))


# ----------------------------------------------------------------------------------------------- errors


class _Broken(ShuffleBufferStream):
    """The user stream with one mistake, chosen by ``mistake``."""

    mistake = ""

    def state_dict(self):
        state = super().state_dict()
        if self.mistake == "numpy" or (self.mistake == "numpy-later" and self.served >= 3):
            state["read"] = np.int64(self.read)
        if self.mistake == "nan":
            state["loss"] = float("nan")
        if self.mistake == "not-a-dict":
            return [state]
        return state

    def load_state_dict(self, state):
        if self.mistake == "list-for-tuple":  # random.setstate wants a tuple
            self.rng.setstate(state["rng"])
        if self.mistake == "ignores-state":
            return
        super().load_state_dict(state)

    def next_batch(self):
        if self.mistake == "short":
            return super().next_batch()[:-1]
        if self.mistake == "ends" and self.served == 2:
            raise StopIteration
        return super().next_batch()


def broken(mistake: str, cfg: RLConfig, log: Path):
    def make(tokenizer):
        renderer = PromptRenderer(tokenizer)
        data = _Broken(PROBLEMS, cfg.groups_per_batch, lambda p: ProblemGroupBuilder(renderer, p, digit_share, cfg.group_size), 0, log)
        data.mistake = mistake
        return data, []

    return make


@pytest.mark.anyio
@pytest.mark.parametrize(
    "mistake, field",
    [
        ("numpy", "state_dict"),
        ("nan", "state_dict"),
        ("not-a-dict", "state_dict"),
        ("list-for-tuple", "load_state_dict"),
    ],
)
async def test_a_state_that_cannot_be_saved_fails_before_the_first_step(tmp_path, mistake, field):
    cfg = BASE.model_copy(update={"max_steps": 2, "save_every": 1})
    with pytest.raises(InvalidInputError) as err:
        await train_rl(cfg, broken(mistake, cfg, tmp_path / "draws"), tmp_path / "run", progress=False)
    assert err.value.field == field and "_Broken" in str(err.value) and err.value.fix
    assert not (tmp_path / "run" / CHECKPOINTS_FILE).exists() and not (tmp_path / "draws").exists()  # nothing drawn or saved


@pytest.mark.anyio
@pytest.mark.parametrize("mistake, field", [("numpy-later", "state_dict"), ("short", "next_batch"), ("ends", "next_batch")])
async def test_a_draw_that_goes_wrong_mid_run_leaves_whole_checkpoints(tmp_path, mistake, field):
    cfg = BASE.model_copy(update={"max_steps": 6, "save_every": 1})
    with pytest.raises(InvalidInputError) as err:
        await train_rl(cfg, broken(mistake, cfg, tmp_path / "draws"), tmp_path / "run", progress=False)
    assert err.value.field == field and "_Broken" in str(err.value)
    lines = (tmp_path / "run" / CHECKPOINTS_FILE).read_text().splitlines() if mistake != "short" else []
    assert all(json.loads(line)["extra"]["dataset"]["state"] for line in lines)  # every record whole
    if mistake != "short":
        assert 1 <= len(lines) <= 3


@pytest.mark.anyio
async def test_resuming_with_a_dataset_that_does_not_fit_is_refused(tmp_path):
    cfg = BASE.model_copy(update={"max_steps": 2, "save_every": 1})
    await run(cfg, tmp_path / "stream")
    await train_rl(cfg, problem_datasets(PROBLEMS, [], digit_share, cfg), tmp_path / "indexed", progress=False)
    more = cfg.model_copy(update={"max_steps": 4})

    def shuffled(items):
        def make(tokenizer):
            renderer = PromptRenderer(tokenizer)
            build = lambda p: ProblemGroupBuilder(renderer, p, digit_share, cfg.group_size)  # noqa: E731
            return ShuffledDataset(items, cfg.groups_per_batch, build), []

        return make

    await train_rl(cfg, shuffled(PROBLEMS), tmp_path / "shuffled", progress=False)
    await train_rl(cfg, broken("", cfg, tmp_path / "draws"), tmp_path / "careless", progress=False)
    cases = [
        (tmp_path / "stream", shuffled(PROBLEMS), "make_datasets", "a ShuffleBufferStream, make_datasets returned a ShuffledDataset"),
        (tmp_path / "stream", problem_datasets(PROBLEMS, [], digit_share, cfg), "make_datasets", "index-addressed"),
        (tmp_path / "indexed", shuffled(PROBLEMS), "make_datasets", "no dataset state"),
        (tmp_path / "shuffled", shuffled(PROBLEMS[:5]), "items", "12 items"),  # the same class, a state it cannot take
        (tmp_path / "careless", broken("ignores-state", cfg, tmp_path / "draws"), "load_state_dict", "round-trip"),
        (tmp_path / "new", lambda tokenizer: (object(), []), "make_datasets", "neither"),
    ]
    for run_dir, make, field, words in cases:
        before = (run_dir / CHECKPOINTS_FILE).read_text() if run_dir.exists() else None
        with pytest.raises(InvalidInputError) as err:
            await train_rl(more, make, run_dir, progress=False)
        assert err.value.field == field and words in str(err.value), str(err.value)
        assert before is None or (run_dir / CHECKPOINTS_FILE).read_text() == before  # nothing trained or saved
    resumed = await run(more, tmp_path / "stream")  # the right dataset still resumes
    assert resumed.steps == 4


# ------------------------------------------------------------------------------------- kill and resume


def _train_in_subprocess(cfg: RLConfig, run_dir: Path, stall_after: int | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if stall_after is not None:
        env["STALL_AFTER_CHECKPOINT"] = str(stall_after)
    code = f"from tests.recipes.user_stream import main; main({cfg.model_dump_json()!r}, {str(run_dir)!r})"
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.anyio
async def test_a_killed_training_process_resumes_bit_for_bit(tmp_path):
    """SIGKILL the training process just after checkpoint 2 (frozen in the dataset's next draw, groups in flight),
    run it again in the same directory: weights, optimizer state, data order and metrics rows equal an
    uninterrupted run's. Checkpoints outlive the process in ``mock://?checkpoint_dir=``."""
    url = f"mock://?checkpoint_dir={tmp_path / 'store'}"
    cfg = BASE.model_copy(update={"url": url, "max_steps": 5, "save_every": 2, "max_staleness": 2})
    whole = await run(cfg.model_copy(update={"url": "mock://"}), tmp_path / "whole")

    killed = _train_in_subprocess(cfg, tmp_path / "run", stall_after=2)
    deadline = time.monotonic() + 120  # a guard against a hang, not a speed claim
    while not (tmp_path / "run" / "stalled").exists():
        assert killed.poll() is None, killed.communicate()
        assert time.monotonic() < deadline, "the training process never got past checkpoint 2"
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL
    record = last_checkpoint(tmp_path / "run")
    assert record is not None and record.step == 2 and not record.final

    again = _train_in_subprocess(cfg, tmp_path / "run")
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    final = json.loads(out.splitlines()[-1])
    assert final["final"] and final["step"] == 5
    assert_same_state(await state(whole.final_checkpoint.state_path), await state(final["state_path"], url), 5)
    assert drawn(tmp_path / "run" / "draws.jsonl") == drawn(tmp_path / "whole" / "draws.jsonl")
    assert comparable(tmp_path / "run") == comparable(tmp_path / "whole")


def test_drawn_batches_keep_what_is_still_needed(tmp_path):
    """Batch i is the i-th draw; batches below ``needed()`` are forgotten; ``state(first)`` is the state
    before the batch of group ``first``, and restoring it draws the same batches again."""
    from asyncsess.rl.datasets import DrawnBatches

    @dataclass(frozen=True)
    class Named:  # a group builder that compares by its problem
        question: str

        async def make_envs(self) -> list:
            return []

    def stream() -> ShuffleBufferStream:
        return ShuffleBufferStream(PROBLEMS, 2, lambda p: Named(p.question), 3, tmp_path / "log")  # type: ignore[arg-type,return-value]

    data = DrawnBatches(stream(), 2)
    needed = [0]
    data.needed = lambda: needed[0]
    assert data.get_batch(3) and len(data) == 4 and data.first == 0  # drew batches 0..3
    batches = [list(data.get_batch(i)) for i in range(4)]
    saved = data.state(5)  # group 5 is in batch 2
    assert saved["batch"] == 2 and saved["state"]["served"] == 2 and saved["type"].endswith("ShuffleBufferStream")
    needed[0] = 5
    data.get_batch(4)  # a new draw forgets batches 0 and 1
    assert data.first == 2 and len(data.kept) == 3
    with pytest.raises(RuntimeError):
        data.get_batch(1)
    with pytest.raises(RuntimeError):
        data.state(2)
    again = DrawnBatches(stream(), 2, json.loads(json.dumps(saved)))
    assert again.first == 2 and [list(again.get_batch(i)) for i in (2, 3)] == batches[2:]
    assert again.state(6)["state"] == data.state(6)["state"]  # at batch 3, a drawn one
    assert again.get_batch(4) == data.get_batch(4) and again.state(10)["state"] == data.state(10)["state"]  # the next to draw
