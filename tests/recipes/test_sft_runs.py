"""Chat datums, SFT pipelining and schedules, metrics.jsonl and checkpoints.jsonl."""

import json
import math

import numpy as np
import pytest

from asyncsess import AdamParams, InvalidInputError, ServiceClient
from asyncsess.chat import assistant_spans, turn_stop_tokens
from asyncsess.rl import RLConfig
from asyncsess.runs.checkpoints import last_checkpoint, parse_overrides, prepare_run_dir, save_checkpoint
from asyncsess.runs.metrics import MetricsLogger, read_metrics
from asyncsess.supervised.sft import SubmitAhead, conversation_datum, learning_rate, mean_nll, nll
from asyncsess_mock import CharTokenizer

pytestmark = pytest.mark.anyio
TOK = CharTokenizer()
CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "6"},
]


def test_conversation_datum_trains_on_assistant_tokens_only():
    d = conversation_datum(TOK, CONV)
    targets, weights = d.loss_fn_inputs["target_tokens"].data, d.loss_fn_inputs["weights"].data
    trained = TOK.decode([t for t, w in zip(targets, weights) if w])
    assert trained == "4<|end|>6<|end|>"
    last = conversation_datum(TOK, CONV, train_on="last_assistant_message")
    assert TOK.decode([t for t, w in zip(targets, last.loss_fn_inputs["weights"].data) if w]) == "6<|end|>"
    assert d.model_input.to_ints() + [targets[-1]] == TOK.apply_chat_template(CONV)
    with pytest.raises(InvalidInputError):
        conversation_datum(TOK, CONV[:2])


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"train_on": "last"}, "train_on"),  # a typo trained on every assistant message
        ({"max_length": 1}, "max_length"),  # an empty datum, refused only by forward_backward
        ({"max_length": 0}, "max_length"),
        ({"messages": "2+2? 4"}, "messages"),  # an AttributeError
        ({"messages": ["2+2?", "4"]}, "messages"),
    ],
)
def test_conversation_datum_refuses_what_it_cannot_train_naming_the_argument(args, field):
    with pytest.raises(InvalidInputError) as err:
        conversation_datum(TOK, **{"messages": CONV, **args})
    assert err.value.field == field and err.value.fix


async def test_sft_chat_refuses_data_shorter_than_one_batch(tmp_path):
    from examples import sft_chat

    with pytest.raises(InvalidInputError) as err:  # was a run of 0 steps that looked finished
        await sft_chat.main(["batch_size=64", f"run_dir={tmp_path}"])
    assert err.value.field == "batch_size" and "fewer than one batch of 64" in str(err.value)


def test_assistant_spans_and_turn_stops():
    tokens, spans = assistant_spans(TOK, CONV)
    assert [TOK.decode(tokens[a:b]) for a, b in spans] == ["4<|end|>", "6<|end|>"]
    assert set(turn_stop_tokens(TOK)) == {TOK.convert_tokens_to_ids("<|end|>"), TOK.eos_token_id}


def test_learning_rate_schedules():
    assert learning_rate(1.0, 0, 10) == 1.0 and learning_rate(1.0, 5, 10) == 0.5 and learning_rate(1.0, 10, 10) == 0.0
    assert learning_rate(1.0, 5, 10, "cosine") == pytest.approx(0.5) and learning_rate(2.0, 7, 10, "constant") == 2.0
    with pytest.raises(InvalidInputError) as err:  # was a constant rate
        learning_rate(1.0, 5, 10, "Linear")  # type: ignore[arg-type]
    assert err.value.field == "schedule"


async def test_submit_ahead_keeps_the_next_step_queued_before_reading_results():
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("m", rank=4)
        data = [conversation_datum(TOK, CONV)]
        pipe = SubmitAhead(submit_ahead=1)
        done = []
        for step in range(3):
            fb = tc.forward_backward(data, "cross_entropy")
            opt = tc.optim_step(AdamParams(learning_rate=0.1))
            out = await pipe.push(step, fb, opt)
            if step == 0:
                assert out == [] and tc.current_sequence_number == 2
            else:  # the step before this one comes back only once this one is queued
                assert [s for s, _, _ in out] == [step - 1] and tc.current_sequence_number == 2 * (step + 1)
            done += out
        done += await pipe.drain()
        assert [s for s, _, _ in done] == [0, 1, 2]
        assert [o.step for _, _, o in done] == [1, 2, 3]
        before = mean_nll(done[0][1], data)  # per trained token, at the initial weights
        assert await nll(tc, data) < before - 0.5


def test_metrics_logger_writes_lines_and_drops_rewritten_steps_on_resume(tmp_path):
    with MetricsLogger(tmp_path) as log:
        for s in range(4):
            log.log(s, {"env/all/reward/total": s / 10, "bad": float("nan")})
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3]
    assert read_metrics(tmp_path)[0]["bad"] is None
    with MetricsLogger(tmp_path, resume_step=2) as log:
        log.log(2, {"x": 1})
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]


def test_metrics_logger_writes_what_a_resume_reads_back(tmp_path):
    """numpy values were a TypeError; a NaN inside a list was written as NaN, and read_metrics then refused the
    line, so the run could not resume; a "step" among the metrics replaced the line's step."""
    with MetricsLogger(tmp_path) as log:
        log.log(0, {"a": np.float32(0.5), "n": np.int64(3), "ok": np.bool_(True), "hist": np.array([1.0, np.nan]), "d": {"x": [math.inf]}})
        with pytest.raises(InvalidInputError) as err:
            log.log(1, {"obj": object()})
        assert err.value.field == "metrics"
        with pytest.raises(InvalidInputError) as err:
            log.log(1, {"step": 2.0})
        assert err.value.field == "metrics.step"
        log.log(1, {"step": 1, "b": 1.0})
    assert read_metrics(tmp_path) == [
        {"step": 0, "a": 0.5, "n": 3, "ok": True, "hist": [1.0, None], "d": {"x": [None]}},
        {"step": 1, "b": 1.0},
    ]


async def test_checkpoint_records_and_resume_point(tmp_path):
    cfg = RLConfig(max_steps=3)
    path, record = prepare_run_dir(tmp_path / "run", cfg)
    assert record is None and json.loads((path / "config.json").read_text())["max_steps"] == 3
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("m", rank=4)
        await save_checkpoint(tc, path, "a", 1)
        await save_checkpoint(tc, path, "b", 2, kind="sampler")
    last = last_checkpoint(path)
    assert last is not None and last.name == "a" and last.state_path.startswith("mock://")
    assert last_checkpoint(path, "sampler_path").name == "b"
    _, again = prepare_run_dir(path, cfg.model_copy(update={"max_steps": 9}))  # a longer run resumes
    assert again == last
    with pytest.raises(InvalidInputError):
        prepare_run_dir(path, cfg.model_copy(update={"learning_rate": 1.0}))
    with pytest.raises(InvalidInputError):
        prepare_run_dir(path, cfg, if_exists="raise")
    _, fresh = prepare_run_dir(path, cfg, if_exists="overwrite")
    assert fresh is None and not (path / "checkpoints.jsonl").exists()


def test_parse_overrides():
    assert parse_overrides(["max_steps=3", "url=mock://?seed=1", 'loss_fn_config={"clip_low_threshold": 0.7}', "lr=1e-4"]) == {
        "max_steps": 3,
        "url": "mock://?seed=1",
        "loss_fn_config": {"clip_low_threshold": 0.7},
        "lr": 1e-4,
    }
    with pytest.raises(InvalidInputError):
        parse_overrides(["max_steps"])
