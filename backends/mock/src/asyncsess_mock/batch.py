"""Turn a list of Datums into flat, validated numpy arrays for one loss call."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from asyncsess.errors import InvalidInputError
from asyncsess.types import FLOAT_KEYS, INT_KEYS, Datum, TensorData

from .losses import MULTI_TARGET_LOSSES, REQUIRED_INPUTS

__all__ = ["Batch", "pack_batch"]

_KNOWN_KEYS = INT_KEYS | FLOAT_KEYS


@dataclass(frozen=True)
class Batch:
    """Every target of every datum, flattened in order.

    ``inputs[t]`` is the token that predicts ``targets[t]``; ``seg[t]`` is its datum index; datum ``i``
    owns ``targets[offsets[i]:offsets[i + 1]]`` and its outputs have shape ``shapes[i]``.
    """

    inputs: np.ndarray
    targets: np.ndarray
    seg: np.ndarray
    offsets: np.ndarray
    shapes: list[list[int]]
    tensors: dict[str, np.ndarray]
    num_tokens: int


def _tensor(value: object) -> TensorData:
    return value if isinstance(value, TensorData) else TensorData.coerce("", value)


def pack_batch(data: Sequence[Datum], loss_fn: str, vocab_size: int, max_context: int) -> Batch:
    """Validate shapes, keys and token ranges; raise :class:`InvalidInputError` naming the datum and field.

    Lists are checked by length and joined first, then converted once per column (the hot path).
    """
    if not data:
        raise InvalidInputError("no datums", field="data", fix="pass at least one Datum")
    required = REQUIRED_INPUTS[loss_fn]
    xs: list[list[int]] = []
    ys: list[list[int]] = []
    shapes: list[list[int]] = []
    lengths: list[int] = []
    widths: list[int] = []
    columns: dict[str, list] = {}
    for i, datum in enumerate(data):
        lfi = datum.loss_fn_inputs
        for key in required:
            if key not in lfi:
                raise InvalidInputError(f"{loss_fn} needs {key!r}", field=f"data[{i}].loss_fn_inputs", fix=f"provide {', '.join(required)}")
        tokens = datum.model_input.to_ints()
        n = len(tokens)
        if n == 0 or n > max_context:
            raise InvalidInputError(f"{n} input tokens", field=f"data[{i}].model_input", fix=f"use 1..{max_context} tokens per datum")
        target = _tensor(lfi["target_tokens"])
        shape = list(target.shape) if target.shape else [len(target.data)]
        if shape != [n] and not (len(shape) == 2 and shape[0] == n and loss_fn in MULTI_TARGET_LOSSES):
            raise InvalidInputError(
                f"shape {shape} does not match the {n} input tokens",
                field=f"data[{i}].loss_fn_inputs['target_tokens']",
                fix=f"position t predicts target_tokens[t]: give shape [{n}]" + (f" or [{n}, K]" if loss_fn in MULTI_TARGET_LOSSES else ""),
            )
        size = len(target.data)
        xs.append(tokens)
        ys.append(target.data)  # type: ignore[arg-type]
        shapes.append(shape)
        lengths.append(n)
        widths.append(size // n)
        for key, value in lfi.items():
            if key == "target_tokens":
                continue
            if key not in _KNOWN_KEYS:
                raise InvalidInputError(
                    f"unknown key {key!r}", field=f"data[{i}].loss_fn_inputs", fix=f"known keys: {', '.join(sorted(_KNOWN_KEYS))}"
                )
            values = _tensor(value).data
            if len(values) != size:
                raise InvalidInputError(
                    f"{len(values)} values for {size} targets",
                    field=f"data[{i}].loss_fn_inputs[{key!r}]",
                    fix=f"give one value per target token (shape {shape})",
                )
            columns.setdefault(key, []).append(values)
    for key, parts in columns.items():
        if len(parts) != len(data):
            raise InvalidInputError(
                f"only some datums carry {key!r}", field=f"data[*].loss_fn_inputs[{key!r}]", fix="give it on every datum or on none"
            )
    lengths_arr = np.asarray(lengths)
    sizes = lengths_arr * np.asarray(widths)
    x = _join(xs, np.int64)
    y = _join(ys, np.int64)
    _check_range(x, lengths_arr, vocab_size, "model_input")
    _check_range(y, sizes, vocab_size, "loss_fn_inputs['target_tokens']")
    if max(widths) > 1:
        x = np.repeat(x, np.repeat(widths, lengths))
    return Batch(
        inputs=x,
        targets=y,
        seg=np.repeat(np.arange(len(data)), sizes),
        offsets=np.concatenate(([0], np.cumsum(sizes))),
        shapes=shapes,
        tensors={key: _join(parts, np.float64) for key, parts in columns.items()},
        num_tokens=int(lengths_arr.sum()),
    )


def _join(parts: list[list], dtype: type) -> np.ndarray:
    return np.fromiter(itertools.chain.from_iterable(parts), dtype=dtype, count=sum(map(len, parts)))


def _check_range(flat: np.ndarray, sizes: np.ndarray, vocab_size: int, where: str) -> None:
    bad = np.flatnonzero((flat < 0) | (flat >= vocab_size))
    if bad.size:
        datum = int(np.searchsorted(np.cumsum(sizes), bad[0], side="right"))
        raise InvalidInputError(
            f"token id {int(flat[bad[0]])} is outside the vocabulary [0, {vocab_size})",
            field=f"data[{datum}].{where}",
            fix="use ids from this backend's tokenizer (get_tokenizer)",
        )
