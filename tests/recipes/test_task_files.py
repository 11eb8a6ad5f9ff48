"""A user's own problem files for the task loaders (``asyncsess.tasks.rows``, ``gsm8k.load``) and the arithmetic
generator's arguments: what is not a problem is an InvalidInputError naming the file, the line, the key and the fix
when the data is loaded (a bare JSONDecodeError, KeyError, TypeError, ... before, or no problems at all)."""

from __future__ import annotations

import pytest

from asyncsess.errors import InvalidInputError
from asyncsess.tasks import arithmetic, gsm8k, rows

GOOD = b'{"question": "Q?", "answer": "work\\n#### 42"}\n'
BAD_FILES = [  # (what the file holds, the line named, the field named, words of the message)
    (GOOD + b'{"question": "Q?", "answer": "#### 1"\n', 2, "g.jsonl", "not JSON"),
    (GOOD + b'\n{"question": "Q?"}\n', 3, "g.jsonl.answer", "no 'answer'"),
    (b'{"question": "Q?", "answer": 42}\n', 1, "g.jsonl.answer", "not a string"),
    (b'{"question": ["Q?"], "answer": "#### 1"}\n', 1, "g.jsonl.question", "not a string"),
    (b'{"question": "Q?", "answer": "42"}\n', 1, "g.jsonl.answer", "no '#### <number>'"),
    (b'["Q?", "#### 42"]\n', 1, "g.jsonl", "JSON list, not an object"),
    ('{"question": "caf\xe9?", "answer": "#### 1"}\n'.encode("latin-1"), 1, "g.jsonl", "not UTF-8"),
    (b"[" * 100_000 + b"\n", 1, "g.jsonl", "not JSON"),  # RecursionError
    (b'{"question": "Q?", "answer": ' + b"9" * 5000 + b"}\n", 1, "g.jsonl", "not JSON"),  # an int past 4300 digits
    (b"", None, "g.jsonl", "holds no rows"),  # was [] : a run with nothing to train or test on
    (b"\n \n", None, "g.jsonl", "holds no rows"),
]


@pytest.mark.parametrize(("data", "line", "field", "words"), BAD_FILES, ids=range(len(BAD_FILES)))
def test_a_bad_gsm8k_file_names_its_line_key_and_fix(tmp_path, data, line, field, words):
    path = tmp_path / "g.jsonl"
    path.write_bytes(data)
    with pytest.raises(InvalidInputError) as err:
        gsm8k.load(path=path)
    where = f"{path}:{line}:" if line is not None else f"{path}:"
    assert err.value.field == field and where in str(err.value) and words in str(err.value), str(err.value)
    assert err.value.fix == gsm8k.FIX


def test_a_directory_a_missing_file_and_a_line_too_long_are_named(tmp_path, monkeypatch):
    for path, words in [(tmp_path, "is a directory"), (tmp_path / "absent.jsonl", "does not exist")]:
        with pytest.raises(InvalidInputError, match=words) as err:
            gsm8k.load(path=path)
        assert str(path) in str(err.value)
    path = tmp_path / "g.jsonl"
    path.write_bytes(GOOD + b'{"question": "' + b"x" * 100 + b'", "answer": "#### 1"}\n')
    monkeypatch.setattr(rows, "MAX_LINE_BYTES", 64)
    with pytest.raises(InvalidInputError, match=f"{path}:2: the line is longer than 64 bytes"):
        gsm8k.load(path=path)


def test_limit_is_a_positive_count(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_bytes(GOOD * 3)
    assert len(gsm8k.load(path=path, limit=2)) == 2
    for limit in (0, -1, True):  # -1 silently dropped the last problem
        with pytest.raises(InvalidInputError) as err:
            gsm8k.load(path=path, limit=limit)
        assert err.value.field == "limit"


@pytest.mark.parametrize(("ops", "n"), [("*", 1), ("+*", 1), ("++", 1), ("", 1), ("+", -1)])
def test_arithmetic_takes_only_the_ops_it_can_answer(ops, n):
    """``ops="*"`` made "What is 3 * 4?" with the answer -1 (every op but "+" was computed as "-"), and "++" counted
    each op twice (asking for 10,001 of its 10,000 problems drew for ever)."""
    with pytest.raises(InvalidInputError) as err:
        arithmetic.make_problems(n, seed=0, ops=ops)
    assert err.value.field == ("n" if ops == "+" else "ops")
