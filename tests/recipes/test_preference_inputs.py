"""What train_preference is handed, checked before its run directory is emptied or a session opened (torch-free:
nothing here reaches the loss)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from asyncsess.errors import InvalidInputError
from asyncsess.rl import RLConfig
from asyncsess.runs.checkpoints import prepare_run_dir
from asyncsess.supervised.preference import PreferenceConfig, train_preference

pytestmark = pytest.mark.anyio
PAIRS = Path(__file__).resolve().parents[2] / "examples" / "data" / "preferences.jsonl"
ROWS = [json.loads(line) for line in PAIRS.read_text().splitlines()]


def data(tmp_path: Path, lines: list[str]) -> str:
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    return str(tmp_path / "data.jsonl")


@pytest.mark.parametrize(
    ("lines", "field", "says"),
    [
        ([json.dumps(r) for r in ROWS[:3]], "batch_size", "fewer than one batch of 8"),  # was a run of 0 steps
        ([], "data", "holds no rows"),  # was named batch_size: 0 rows
        ([json.dumps(ROWS[0]), '{"prompt": '], "data", "data.jsonl:2: the line is not JSON"),  # was a JSONDecodeError
        ([json.dumps({"prompt": ROWS[0]["prompt"], "chosen": "a"})], "data.rejected", "has no 'rejected'"),  # a KeyError
        ([json.dumps(ROWS[0] | {"prompt": "What is 2 + 2?"})], "data.prompt", "not a list of chat messages"),  # an AttributeError
        ([json.dumps(ROWS[0] | {"prompt": ["hi"]})], "data.prompt", "data.jsonl:1: prompt is ['hi'], not a list of chat messages"),
        ([json.dumps(ROWS[0] | {"chosen": 4})], "data.chosen", "not a string"),
        # the shared row reader's checks (asyncsess.tasks.rows), which the preference loader did not make
        (
            [json.dumps(ROWS[0]), '{"prompt": [{"role": "user", "content": NaN}], "chosen": "a", "rejected": "b"}'],
            "data.prompt.0.content",
            ":2: NaN",
        ),
        ([json.dumps(ROWS[0]), json.dumps(ROWS[1] | {"chosen": "\ud800"})], "data", "data.jsonl:2: a string holds a lone surrogate"),
    ],
)
async def test_bad_data_is_refused_naming_it_before_the_run_directory_is_emptied(tmp_path, lines, field, says):
    run = tmp_path / "run"
    prepare_run_dir(run, PreferenceConfig(method="dpo", data=str(PAIRS)))  # a previous preference run's directory
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(InvalidInputError) as err:
        await train_preference(PreferenceConfig(method="dpo", data=data(tmp_path, lines)), run)
    assert err.value.field == field and says in str(err.value) and err.value.fix
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n'  # was emptied before the data was read


async def test_a_line_that_is_not_utf8_is_named_by_its_number(tmp_path):
    """The whole file was decoded at once: "cannot be read (...)", with no line."""
    path = tmp_path / "feedback.jsonl"
    path.write_bytes(b'{"prompt": [], "completion": "a", "label": true}\n{"completion": "\xff"}\n')
    with pytest.raises(InvalidInputError) as err:
        await train_preference(PreferenceConfig(method="kto", data=str(path)), tmp_path / "run")
    assert err.value.field == "data" and "feedback.jsonl:2: the line is not UTF-8" in str(err.value)


async def test_a_kto_label_that_is_not_a_bool_is_named(tmp_path):
    rows = [json.dumps({"prompt": [], "completion": "a", "label": True})] * 3 + [
        json.dumps({"prompt": [], "completion": "b", "label": "yes"})
    ]
    with pytest.raises(InvalidInputError) as err:
        await train_preference(PreferenceConfig(method="kto", data=data(tmp_path, rows)), tmp_path / "run")
    assert err.value.field == "data.label" and "data.jsonl:4: label is 'yes', not true or false" in str(err.value)


async def test_a_missing_data_file_is_named(tmp_path):
    with pytest.raises(InvalidInputError) as err:  # was a FileNotFoundError after the session opened
        await train_preference(PreferenceConfig(method="kto", data=str(tmp_path / "nope.jsonl")), tmp_path / "run")
    assert err.value.field == "data" and "nope.jsonl" in str(err.value)


async def test_the_directory_of_another_recipes_run_is_not_emptied(tmp_path):
    prepare_run_dir(tmp_path, RLConfig())
    (tmp_path / "checkpoints.jsonl").write_text("")  # an RL run's files
    with pytest.raises(InvalidInputError) as err:
        await train_preference(PreferenceConfig(method="dpo", data=str(PAIRS)), tmp_path)
    assert err.value.field == "run_dir" and (tmp_path / "checkpoints.jsonl").exists()


@pytest.mark.parametrize("bad", [{"seed": -1}, {"seed": 2**70}, {"learning_rate": 1e9}])
def test_a_seed_or_learning_rate_out_of_range_is_refused_naming_it(bad):
    with pytest.raises(ValidationError, match=next(iter(bad))):  # were refused by the backend, after the directory was emptied
        PreferenceConfig(method="dpo", data="x.jsonl", **bad)
