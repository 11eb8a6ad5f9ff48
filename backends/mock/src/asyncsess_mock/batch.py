"""Turn a list of Datums into flat, validated numpy arrays for one loss call."""

from __future__ import annotations

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


def _array(value: object, dtype: type) -> np.ndarray:
    td = value if isinstance(value, TensorData) else TensorData.coerce("", value)
    arr: np.ndarray = np.asarray(td.data, dtype=dtype)
    return arr.reshape(td.shape) if td.shape else arr


def pack_batch(data: Sequence[Datum], loss_fn: str, vocab_size: int, max_context: int) -> Batch:
    """Validate shapes, keys and token ranges; raise :class:`InvalidInputError` naming the datum and field."""
    if not data:
        raise InvalidInputError("no datums", field="data", fix="pass at least one Datum")
    required = REQUIRED_INPUTS[loss_fn]
    xs, ys, shapes, sizes = [], [], [], []
    num_tokens = 0
    columns: dict[str, list[np.ndarray]] = {}
    for i, datum in enumerate(data):
        lfi = datum.loss_fn_inputs
        for key in required:
            if key not in lfi:
                raise InvalidInputError(f"{loss_fn} needs {key!r}", field=f"data[{i}].loss_fn_inputs", fix=f"provide {', '.join(required)}")
        tokens = np.asarray(datum.model_input.to_ints(), dtype=np.int64)
        n = tokens.size
        if n == 0 or n > max_context:
            raise InvalidInputError(f"{n} input tokens", field=f"data[{i}].model_input", fix=f"use 1..{max_context} tokens per datum")
        target = _array(lfi["target_tokens"], np.int64)
        if target.shape != (n,) and not (target.ndim == 2 and target.shape[0] == n and loss_fn in MULTI_TARGET_LOSSES):
            raise InvalidInputError(
                f"shape {list(target.shape)} does not match the {n} input tokens",
                field=f"data[{i}].loss_fn_inputs['target_tokens']",
                fix=f"position t predicts target_tokens[t]: give shape [{n}]" + (f" or [{n}, K]" if loss_fn in MULTI_TARGET_LOSSES else ""),
            )
        k = target.shape[1] if target.ndim == 2 else 1
        xs.append(np.repeat(tokens, k) if k > 1 else tokens)
        ys.append(target.ravel())
        shapes.append(list(target.shape))
        sizes.append(target.size)
        num_tokens += n
        for key, value in lfi.items():
            if key == "target_tokens":
                continue
            if key not in _KNOWN_KEYS:
                raise InvalidInputError(
                    f"unknown key {key!r}", field=f"data[{i}].loss_fn_inputs", fix=f"known keys: {', '.join(sorted(_KNOWN_KEYS))}"
                )
            arr = _array(value, np.float64)
            if arr.size != target.size:
                raise InvalidInputError(
                    f"{arr.size} values for {target.size} targets",
                    field=f"data[{i}].loss_fn_inputs[{key!r}]",
                    fix=f"give one value per target token (shape {list(target.shape)})",
                )
            columns.setdefault(key, []).append(arr.ravel())
    for key, parts in columns.items():
        if len(parts) != len(data):
            raise InvalidInputError(
                f"only some datums carry {key!r}", field=f"data[*].loss_fn_inputs[{key!r}]", fix="give it on every datum or on none"
            )
    x = np.concatenate(xs)
    y = np.concatenate(ys)
    _check_range(x, xs, vocab_size, "model_input")
    _check_range(y, ys, vocab_size, "loss_fn_inputs['target_tokens']")
    sizes_arr = np.asarray(sizes)
    return Batch(
        inputs=x,
        targets=y,
        seg=np.repeat(np.arange(len(data)), sizes_arr),
        offsets=np.concatenate(([0], np.cumsum(sizes_arr))),
        shapes=shapes,
        tensors={key: np.concatenate(parts) for key, parts in columns.items()},
        num_tokens=num_tokens,
    )


def _check_range(flat: np.ndarray, parts: list[np.ndarray], vocab_size: int, where: str) -> None:
    if flat.size and (flat.min() < 0 or flat.max() >= vocab_size):
        for i, part in enumerate(parts):
            bad = part[(part < 0) | (part >= vocab_size)]
            if bad.size:
                raise InvalidInputError(
                    f"token id {int(bad[0])} is outside the vocabulary [0, {vocab_size})",
                    field=f"data[{i}].{where}",
                    fix="use ids from this backend's tokenizer (get_tokenizer)",
                )
