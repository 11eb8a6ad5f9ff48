"""What a run finds in its directory when it starts or resumes, as a killed process, a careless user or an
attacker leaves it: a torn last line is recovered from, anything else is a typed error naming the file, the
line and the field, before a session is opened or a line is appended."""

import json
import math
import os
from pathlib import Path

import anyio
import numpy as np
import pytest

from asyncsess import ServiceClient
from asyncsess.errors import InvalidInputError
from asyncsess.rl import Problem, ProblemGroupBuilder, PromptRenderer, RLConfig, ShuffledDataset, problem_datasets, train_rl
from asyncsess.runs.checkpoints import last_checkpoint, open_run_dir, prepare_run_dir, read_checkpoints, save_checkpoint
from asyncsess.runs.metrics import MetricsLogger, read_metrics

from .helpers import digit_share

pytestmark = pytest.mark.anyio
PROBLEMS = [Problem(f"Code {i}:", "0") for i in range(8)]
BASE = RLConfig(url="mock://", groups_per_batch=2, group_size=2, max_tokens=4, lora_rank=4, max_steps=2)


def record(step: int, name: str = "s", **kw) -> str:
    return json.dumps({"name": name, "step": step, "state_path": f"mock://x/weights/{name}", **kw})


async def saved_run(tmp_path, steps=(1, 2)):
    path, _ = prepare_run_dir(tmp_path / "run", BASE)
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("m", rank=4)
        for s in steps:
            await save_checkpoint(tc, path, f"step-{s}", s)
    return path


@pytest.mark.parametrize("tail", [b'{"name": "step-3", "st', b"\0\0\0\0\0\0", b'{"name": "step-3", "step": "3"'])
async def test_a_torn_last_line_is_dropped_and_cut_off_before_the_next_save(tmp_path, tail):
    path = await saved_run(tmp_path)
    with (path / "checkpoints.jsonl").open("ab") as f:
        f.write(tail)  # SIGKILL mid-write: no "\n"
    last = last_checkpoint(path)
    assert last is not None and last.name == "step-2"
    _, resumed = prepare_run_dir(path, BASE)
    assert resumed == last
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("m", rank=4)
        await save_checkpoint(tc, path, "step-3", 3)
    assert [r.name for r in read_checkpoints(path)] == ["step-1", "step-2", "step-3"]
    assert (path / "checkpoints.jsonl").read_bytes().endswith(b"}\n") and tail not in (path / "checkpoints.jsonl").read_bytes()


async def test_a_whole_last_record_without_its_newline_is_kept_and_ended(tmp_path):
    path = await saved_run(tmp_path)
    text = (path / "checkpoints.jsonl").read_bytes()
    (path / "checkpoints.jsonl").write_bytes(text.rstrip(b"\n"))
    assert last_checkpoint(path).name == "step-2"
    with MetricsLogger(path) as log:
        log.log(0, {"x": 1.0})
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("m", rank=4)
        await save_checkpoint(tc, path, "step-3", 3)
    assert [r.name for r in read_checkpoints(path)] == ["step-1", "step-2", "step-3"]


BAD_LINES = {
    "nul bytes": (b"\0" * 16, None),
    "invalid utf-8": (b'{"name": "\xff\xfe", "step": 1}', None),
    "lone surrogate": (b'{"name": "a", "step": 1, "state_path": "mock://x/\\ud800"}', None),
    "NaN": (b'{"name": "a", "step": 1, "time": NaN}', "time"),
    "Infinity": (b'{"name": "a", "step": 1, "time": -Infinity}', "time"),
    "1e999": (b'{"name": "a", "step": 1, "time": 1e999}', "time"),
    "huge int": (b'{"name": "a", "step": 100000000000000000000000000000}', "step"),
    "5000 digits": (b'{"name": "a", "step": ' + b"9" * 5000 + b"}", None),
    "step as string": (b'{"name": "a", "step": "1"}', "step"),
    "step as bool": (b'{"name": "a", "step": true}', "step"),
    "step as float": (b'{"name": "a", "step": 1.5}', "step"),
    "negative step": (b'{"name": "a", "step": -1}', "step"),
    "no step": (b'{"name": "a"}', "step"),
    "name as int": (b'{"name": 5, "step": 1}', "name"),
    "state_path as list": (b'{"name": "a", "step": 1, "state_path": ["x"]}', "state_path"),
    "an array": (b"[1, 2]", None),
    "deep nesting": (b"[" * 100_000 + b"]" * 100_000, None),
    "decreasing step": (record(0).encode(), "step"),
}


@pytest.mark.parametrize("where", ["middle", "last"])
@pytest.mark.parametrize("case", list(BAD_LINES))
async def test_a_bad_line_is_refused_naming_the_file_line_and_field(tmp_path, case, where):
    line, field = BAD_LINES[case]
    path = tmp_path / "run"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(json.loads(BASE.model_dump_json())))
    lines = [record(1).encode(), line] + ([record(2).encode()] if where == "middle" else [])
    (path / "checkpoints.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    before = (path / "checkpoints.jsonl").read_bytes()
    with pytest.raises(InvalidInputError) as err:
        prepare_run_dir(path, BASE)
    assert "checkpoints.jsonl:2" in str(err.value)
    assert err.value.field == "checkpoints.jsonl" + (f".{field}" if field else "")
    shown = err.value.__cause__ or (None if err.value.__suppress_context__ else err.value.__context__)
    assert shown is None  # no json/pydantic traceback chained under it
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("m", rank=4)
        with pytest.raises(InvalidInputError):
            await save_checkpoint(tc, path, "step-3", 3)  # nothing is appended after a bad line
    assert (path / "checkpoints.jsonl").read_bytes() == before


async def test_an_empty_checkpoints_file_resumes_nothing(tmp_path):
    path, _ = prepare_run_dir(tmp_path / "run", BASE)
    (path / "checkpoints.jsonl").write_bytes(b"")
    assert prepare_run_dir(path, BASE)[1] is None


@pytest.mark.parametrize(
    "line", [b'{"x": 1}', b'{"step": "0"}', b'{"step": 0, "time/total": NaN}', b'{"step": 0, "time/total": "1"}', b"\xff"]
)
def test_a_bad_metrics_line_is_refused_naming_it_and_a_torn_one_recovered(tmp_path, line):
    file = tmp_path / "metrics.jsonl"
    file.write_bytes(b'{"step": 0}\n' + line + b"\n")
    with pytest.raises(InvalidInputError, match="metrics.jsonl:2"):
        read_metrics(tmp_path)
    with pytest.raises(InvalidInputError, match="metrics.jsonl:2"):
        MetricsLogger(tmp_path)
    file.write_bytes(b'{"step": 0}\n' + line)  # the same, torn off by a kill
    with MetricsLogger(tmp_path) as log:
        log.log(1, {"x": 2.0})
    assert read_metrics(tmp_path) == [{"step": 0}, {"step": 1, "x": 2.0}]


def test_a_run_dir_that_is_a_file_or_a_strangers_dir_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidInputError, match="is a file") as err:
        prepare_run_dir(tmp_path / "file", BASE)
    assert err.value.field == "run_dir"
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    with pytest.raises(InvalidInputError, match="not a run directory"):
        prepare_run_dir(home, BASE, if_exists="overwrite")
    assert (home / "thesis.tex").read_text() == "years of work"
    (home / "checkpoints.jsonl").write_text(record(1) + "\n")  # a run's files without its config
    with pytest.raises(InvalidInputError, match="no config.json"):
        prepare_run_dir(home, BASE)


@pytest.mark.parametrize("where", ["under a file", "a dangling link"])
def test_a_run_dir_that_cannot_be_made_is_a_typed_error(tmp_path, where):
    """(No write permission is not tested: the tests run as root, which every permission bit lets through.)"""
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(InvalidInputError, match="cannot be used") as err:
        prepare_run_dir(tmp_path / ("file/run" if where == "under a file" else "link"), BASE)
    assert err.value.field == "run_dir"


def test_an_empty_run_dir_is_refused_not_taken_as_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # `run_dir=` on a recipe's command line wrote config.json and the run files here
    with pytest.raises(InvalidInputError) as err:
        prepare_run_dir("", BASE)
    assert err.value.field == "run_dir" and os.listdir(tmp_path) == []


def test_a_misspelt_if_exists_is_refused_not_taken_as_resume(tmp_path):
    with pytest.raises(InvalidInputError) as err:
        prepare_run_dir(tmp_path / "run", BASE, if_exists="overwite")  # type: ignore[arg-type]
    assert err.value.field == "if_exists" and not (tmp_path / "run").exists()


async def test_overwrite_through_a_symlink_empties_the_run_it_points_at(tmp_path):
    path = await saved_run(tmp_path)
    (tmp_path / "link").symlink_to(path)
    _, record_ = prepare_run_dir(tmp_path / "link", BASE, if_exists="overwrite")
    assert record_ is None and sorted(os.listdir(path)) == ["config.json"] and (tmp_path / "link").is_symlink()


@pytest.mark.parametrize("config", [b"{", b"[1]", b"\xff\xfe", b'{"url": "mock://"'])
async def test_a_config_json_that_is_not_a_config_is_refused(tmp_path, config):
    path = await saved_run(tmp_path)
    (path / "config.json").write_bytes(config)
    with pytest.raises(InvalidInputError, match="config.json") as err:
        prepare_run_dir(path, BASE)
    assert err.value.field == "config.json"
    assert (path / "config.json").read_bytes() == config


@pytest.mark.parametrize("change", [{"base_model": "mock/other"}, {"lora_rank": 8}, {"seed": 3}, {"loss_fn": "importance_sampling"}])
async def test_resume_refuses_a_run_of_another_model_rank_seed_or_recipe(tmp_path, change):
    path = await saved_run(tmp_path)
    with pytest.raises(InvalidInputError, match="different config"):
        prepare_run_dir(path, BASE.model_copy(update=change))


def datasets(cfg):
    return problem_datasets(PROBLEMS, PROBLEMS[:2], digit_share, cfg)


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"cursor": 4, "pending_file": "../../../etc/passwd"}, "pending_file"),
        ({"cursor": 4, "pending_file": "/etc/passwd"}, "pending_file"),
        ({"cursor": 4, "pending_file": "pending-000002.json"}, "pending_file"),  # named, but not there
        ({"cursor": -4}, "cursor"),
        ({"cursor": 4.5}, "cursor"),
        ({"cursor": "4"}, "cursor"),
    ],
)
async def test_a_checkpoints_extra_is_checked_before_a_session_opens(tmp_path, extra, field):
    path = tmp_path / "run"
    await train_rl(BASE, datasets(BASE), path, progress=False)  # a whole run: its last record is final
    records = (path / "checkpoints.jsonl").read_text().splitlines()
    last = json.loads(records[-1])
    (path / "checkpoints.jsonl").write_text("\n".join([*records[:-1], json.dumps({**last, "extra": extra})]) + "\n")
    metrics = (path / "metrics.jsonl").read_bytes()
    with pytest.raises(InvalidInputError) as err:
        await train_rl(BASE, datasets(BASE), path, progress=False)
    assert err.value.field == f"checkpoints.jsonl.extra.{field}"
    assert (path / "metrics.jsonl").read_bytes() == metrics


async def test_a_pending_file_that_is_a_symlink_out_of_the_run_is_refused(tmp_path):
    path = tmp_path / "run"
    await train_rl(BASE, datasets(BASE), path, progress=False)
    records = (path / "checkpoints.jsonl").read_text().splitlines()
    last = json.loads(records[-1])
    (tmp_path / "secret.json").write_text("[]")
    (path / "pending-000009.json").symlink_to(tmp_path / "secret.json")
    last["extra"]["pending_file"] = "pending-000009.json"
    (path / "checkpoints.jsonl").write_text("\n".join([*records[:-1], json.dumps(last)]) + "\n")
    with pytest.raises(InvalidInputError, match="pending-000009.json"):
        await train_rl(BASE, datasets(BASE), path, progress=False)


async def test_a_run_killed_before_its_first_checkpoint_logs_each_step_once(tmp_path):
    path, _ = prepare_run_dir(tmp_path / "run", BASE)
    (path / "metrics.jsonl").write_text('{"step": 0, "stale": 1}\n{"step": 1, "stale": 1}\n{"step": 2, "st')
    await train_rl(BASE, datasets(BASE), path, progress=False)
    records = read_metrics(path)
    assert [r["step"] for r in records] == [0, 1, 2] and not any("stale" in r for r in records)


def shuffled(cfg):
    def make(tokenizer):
        renderer = PromptRenderer(tokenizer)
        return ShuffledDataset(PROBLEMS, cfg.groups_per_batch, lambda p: ProblemGroupBuilder(renderer, p, digit_share, cfg.group_size)), []

    return make


@pytest.mark.parametrize(
    "change, field",
    [
        ({"state": {"position": 10**9}}, "state.position"),  # past the epoch: an IndexError mid-run before
        ({"state": {"position": -1}}, "state.position"),  # silently the last item before
        ({"state": {"epoch": -5}}, "state.epoch"),
        ({"state": {"epoch": True}}, "state.epoch"),
        ({"state": {"rng": {"bit_generator": "PCG64", "state": "x"}}}, "state.rng"),
        ({"state": {"rng": [1, 2]}}, "state.rng"),
        ({"batch": -1}, "checkpoints.jsonl.extra.dataset"),
        ({"batch": "1"}, "checkpoints.jsonl.extra.dataset"),
        ({"state": None}, "checkpoints.jsonl.extra.dataset"),
        (None, "checkpoints.jsonl.extra.dataset"),
    ],
)
async def test_a_tampered_dataset_state_is_refused_before_a_step(tmp_path, change, field):
    cfg = BASE.model_copy(update={"save_every": 1})
    path = tmp_path / "run"
    await train_rl(cfg, shuffled(cfg), path, progress=False)
    records = (path / "checkpoints.jsonl").read_text().splitlines()
    last = json.loads(records[-1])
    dataset = last["extra"]["dataset"]
    if change is None:
        last["extra"]["dataset"] = "a string"
    else:
        for key, value in change.items():
            dataset[key] = {**dataset[key], **value} if isinstance(value, dict) else value
    (path / "checkpoints.jsonl").write_text("\n".join([*records[:-1], json.dumps(last)]) + "\n")
    with pytest.raises(InvalidInputError) as err:
        await train_rl(cfg.model_copy(update={"max_steps": 4}), shuffled(cfg), path, progress=False)
    assert err.value.field == field
    assert max(r["step"] for r in read_metrics(path)) < 2 and last_checkpoint(path).step == 2  # no step trained or saved


async def test_a_second_run_on_a_directory_in_use_is_refused_before_it_writes(tmp_path):
    """Two loops started on one directory appended interleaved checkpoint records (two sessions' 'step-000001'),
    and one's metrics went to a file the other had replaced. Now the second is refused; the first runs whole."""
    cfg = BASE.model_copy(update={"url": "mock://?latency_ms=5", "max_steps": 3, "save_every": 1})
    outcomes: list[object] = []

    async def one():
        try:
            outcomes.append(await train_rl(cfg, datasets(cfg), tmp_path, progress=False))
        except InvalidInputError as err:
            outcomes.append(err)

    async with anyio.create_task_group() as tg:
        tg.start_soon(one)
        tg.start_soon(one)
    refused = [o for o in outcomes if isinstance(o, InvalidInputError)]
    assert len(refused) == 1 and refused[0].field == "run_dir" and "in use" in str(refused[0])
    assert [r.name for r in read_checkpoints(tmp_path)] == ["step-000001", "step-000002", "final-000003"]
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3]


async def test_a_directory_is_free_again_when_its_run_ends(tmp_path):
    with open_run_dir(tmp_path, BASE) as (path, record_):
        assert path == tmp_path and record_ is None
        with pytest.raises(InvalidInputError, match="in use"):
            with open_run_dir(tmp_path, BASE):
                pass
    assert (await train_rl(BASE, datasets(BASE), tmp_path, progress=False)).steps == 2


async def test_a_checkpoint_the_backend_no_longer_has_is_named_and_the_run_resumes_once_cut_back(tmp_path):
    """Its files deleted (another process's mock:// store, a cleaned-up bucket): was the backend's error naming
    ``from_path``, with a fix about paths the user never passed."""
    cfg = BASE.model_copy(update={"max_steps": 3, "save_every": 1})
    await train_rl(cfg, datasets(cfg), tmp_path, progress=False)
    file = tmp_path / "checkpoints.jsonl"
    lines = file.read_text().splitlines()
    gone = json.loads(lines[-1]) | {"state_path": "mock://mock-train-gone-1/weights/final-000003"}
    file.write_text("\n".join([*lines[:-1], json.dumps(gone)]) + "\n")
    more = cfg.model_copy(update={"max_steps": 4})
    with pytest.raises(InvalidInputError) as err:
        await train_rl(more, datasets(more), tmp_path, progress=False)
    assert (
        err.value.field == "checkpoints.jsonl.state_path"
        and "'final-000003'" in str(err.value)
        and "cut checkpoints.jsonl" in err.value.fix
    )
    file.write_text("\n".join(lines[:-1]) + "\n")  # the fix: back to step-000002
    assert (await train_rl(more, datasets(more), tmp_path, progress=False)).steps == 4
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3, 4]


class Killed(BaseException):
    """The process dying mid-write."""


async def test_a_kill_while_a_resumed_run_rewrites_a_pending_file_leaves_the_recorded_one_whole(tmp_path, monkeypatch):
    """Rerunning a finished run takes its final checkpoint again at the same step, rewriting the pending-<step>.json
    its record names. Killed mid-write, that file was left torn, and the run could no longer resume."""
    cfg = BASE.model_copy(update={"url": "mock://?latency_ms=1", "max_steps": 2, "max_staleness": 2})
    await train_rl(cfg, datasets(cfg), tmp_path, progress=False)
    record_ = last_checkpoint(tmp_path)
    assert record_ is not None and record_.extra.get("pending_file") == "pending-000002.json"
    saved = (tmp_path / "pending-000002.json").read_text()
    write_text = Path.write_text

    def dies_halfway(self, text, *args, **kwargs):
        if "pending-" in self.name:
            write_text(self, text[: len(text) // 2], *args, **kwargs)
            raise Killed
        return write_text(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", dies_halfway)
    with pytest.raises(Killed):
        await train_rl(cfg, datasets(cfg), tmp_path, progress=False)
    monkeypatch.undo()
    assert (tmp_path / "pending-000002.json").read_text() == saved
    assert (await train_rl(cfg, datasets(cfg), tmp_path, progress=False)).steps == 2


@pytest.mark.parametrize(
    "tamper",
    [
        lambda g, t: t.update(reward="x"),  # was a TypeError mid-step
        lambda g, t: t["ac"].update(tokens=["a"] * len(t["ac"]["tokens"])),  # was trained on (or a backend error)
        lambda g, t: t["ac"].update(logprobs=t["ac"]["logprobs"][:-1]),
        lambda g, t: t["ac"]["logprobs"].__setitem__(0, 1e400),  # inf in JSON
        lambda g, t: g.update(version=10**6),  # from weights the run never had
        lambda g, t: g.update(index=-5),
        lambda g, t: g["group"].update(trajectories=[]),
    ],
)
async def test_a_pending_file_that_a_run_cannot_have_written_is_refused_before_a_session(tmp_path, tamper):
    cfg = BASE.model_copy(update={"url": "mock://?latency_ms=1", "max_staleness": 2})
    await train_rl(cfg, datasets(cfg), tmp_path, progress=False)
    file = tmp_path / "pending-000002.json"
    groups = json.loads(file.read_text())
    tamper(groups[0], groups[0]["group"]["trajectories"][0]["transitions"][0] if groups[0]["group"]["trajectories"] else None)
    file.write_text(json.dumps(groups))
    with pytest.raises(InvalidInputError) as err:
        await train_rl(cfg.model_copy(update={"max_steps": 3}), datasets(cfg), tmp_path, progress=False)
    assert err.value.field == "checkpoints.jsonl.extra.pending_file" and "pending-000002.json" in str(err.value)


async def test_resuming_over_another_index_addressed_dataset_is_refused(tmp_path):
    """A run over 8 problems, resumed over 12 (or over another dataset class): was trained on silently."""
    cfg = BASE.model_copy(update={"max_steps": 2, "save_every": 1})
    await train_rl(cfg, datasets(cfg), tmp_path, progress=False)
    assert last_checkpoint(tmp_path).extra["data"] == {"type": "ProblemDataset", "batches": 4}
    more = cfg.model_copy(update={"max_steps": 3})
    bigger = problem_datasets([*PROBLEMS, *PROBLEMS[:4]], [], digit_share, more)

    class Renamed:
        def __init__(self, inner):
            self.inner = inner

        def get_batch(self, index):
            return self.inner.get_batch(index)

        def __len__(self):
            return len(self.inner)

    for make in (bigger, lambda tok: (Renamed(datasets(more)(tok)[0]), [])):
        with pytest.raises(InvalidInputError) as err:
            await train_rl(more, make, tmp_path, progress=False)
        assert err.value.field == "make_datasets" and "ProblemDataset" in str(err.value)
    assert (await train_rl(more, datasets(more), tmp_path, progress=False)).steps == 3  # the same one resumes


async def test_a_checkpoints_extra_is_json_data_checked_before_the_save(tmp_path):
    """numpy values in extra were a PydanticSerializationError after the state was saved (a record never written)."""
    path, _ = prepare_run_dir(tmp_path / "run", BASE)
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("m", rank=4)
        await save_checkpoint(tc, path, "s1", 1, extra={"loss": np.float32(0.5), "seen": np.arange(2), "bad": [math.nan]})
        calls = svc.backend.calls["execute_training"]  # saves are training ops
        with pytest.raises(InvalidInputError) as err:
            await save_checkpoint(tc, path, "s2", 2, extra={"obj": object()})
        assert err.value.field == "extra" and svc.backend.calls["execute_training"] == calls  # refused before saving
    assert [r.extra for r in read_checkpoints(path)] == [{"loss": 0.5, "seen": [0, 1], "bad": [None]}]
