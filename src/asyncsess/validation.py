"""Checks run in the client before anything is sent: bad input fails here, with the field and the fix.

A rejected op consumes no sequence number, because these run before one is assigned.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from .errors import InvalidInputError
from .types import FLOAT_KEYS, INT_KEYS, AdamParams, Datum, ModelInput, SamplingParams, TensorData

__all__ = [
    "LOSS_INPUTS",
    "LOSS_CONFIG_KEYS",
    "check_loss_fn",
    "check_datums",
    "check_loss_fn_config",
    "coerce_prompt",
    "coerce_sampling_params",
    "coerce_adam_params",
]

# loss name -> (required keys, optional keys)
_RL_OPTIONAL = frozenset({"weights"})
LOSS_INPUTS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "cross_entropy": (frozenset({"target_tokens", "weights"}), frozenset()),
    "importance_sampling": (frozenset({"target_tokens", "logprobs", "advantages"}), _RL_OPTIONAL),
    "ppo": (frozenset({"target_tokens", "logprobs", "advantages"}), _RL_OPTIONAL),
    "cispo": (frozenset({"target_tokens", "logprobs", "advantages"}), _RL_OPTIONAL),
    "dro": (frozenset({"target_tokens", "logprobs", "advantages"}), _RL_OPTIONAL),
    "gspo": (frozenset({"target_tokens", "logprobs", "advantages"}), _RL_OPTIONAL | {"sequence_ratio_mask"}),
}
_CLIP = frozenset({"clip_low_threshold", "clip_high_threshold"})
LOSS_CONFIG_KEYS: dict[str, frozenset[str]] = {
    "cross_entropy": frozenset(),
    "importance_sampling": frozenset(),
    "ppo": _CLIP,
    "cispo": _CLIP,
    "gspo": _CLIP,
    "dro": frozenset({"beta"}),
}


def check_loss_fn(loss_fn: str, supported: Sequence[str] | None = None) -> str:
    if loss_fn not in LOSS_INPUTS:
        raise InvalidInputError(
            f"unknown loss {loss_fn!r}",
            field="loss_fn",
            fix=f"use one of {', '.join(LOSS_INPUTS)}, or forward_backward_custom for anything else",
        )
    if supported is not None and loss_fn not in supported:
        raise InvalidInputError(
            f"this backend does not offer {loss_fn!r} (it offers {', '.join(supported)})",
            field="loss_fn",
            fix="use forward_backward_custom, which lowers any loss to cross_entropy",
        )
    return loss_fn


def check_loss_fn_config(loss_fn: str, config: Mapping[str, Any] | None) -> dict[str, float] | None:
    if not config:
        return None
    allowed = LOSS_CONFIG_KEYS[loss_fn]
    out: dict[str, float] = {}
    for key, value in config.items():
        if key not in allowed:
            keys = ", ".join(sorted(allowed)) or "none"
            raise InvalidInputError(f"{loss_fn} takes no key {key!r} (it takes: {keys})", field=f"loss_fn_config[{key!r}]", fix="remove it")
        try:
            out[key] = float(value)
        except (TypeError, ValueError, OverflowError):
            raise InvalidInputError(f"{value!r} is not a number", field=f"loss_fn_config[{key!r}]", fix="give a number") from None
        if not math.isfinite(out[key]):
            raise InvalidInputError(f"{value!r} is not finite", field=f"loss_fn_config[{key!r}]", fix="give a finite number")
    lo, hi = out.get("clip_low_threshold"), out.get("clip_high_threshold")
    if lo is not None and lo < 0:
        raise InvalidInputError("must be ≥ 0", field="loss_fn_config['clip_low_threshold']", fix="an absolute ratio bound, e.g. 0.8")
    if hi is not None and hi < 1:
        raise InvalidInputError("must be ≥ 1", field="loss_fn_config['clip_high_threshold']", fix="an absolute ratio bound, e.g. 1.2")
    if out.get("beta", 0.0) < 0:
        raise InvalidInputError("must be ≥ 0", field="loss_fn_config['beta']", fix="give a finite number ≥ 0")
    return out


def _coerce_datum(i: int, item: Any, shared_inputs: Mapping[str, Any] | None, encode: Callable[[str], list[int]] | None) -> Datum:
    if isinstance(item, Datum):
        datum = item
    elif isinstance(item, Mapping):
        try:
            datum = Datum.model_validate(item)
        except (ValidationError, TypeError) as err:
            raise InvalidInputError(
                str(err).splitlines()[0], field=f"data[{i}]", fix="pass a Datum or {'model_input': ..., 'loss_fn_inputs': {...}}"
            ) from None
    elif isinstance(item, str):
        if encode is None:
            raise InvalidInputError("text needs a tokenizer", field=f"data[{i}]", fix="pass token ids")
        datum = Datum.model_construct(model_input=ModelInput.from_ints(encode(item)), loss_fn_inputs={})
    else:
        try:
            datum = Datum.model_construct(model_input=ModelInput.from_any(item), loss_fn_inputs={})
        except TypeError as err:
            raise InvalidInputError(str(err), field=f"data[{i}]", fix="pass a Datum, a dict, or a list of token ids") from None
    if shared_inputs and not datum.loss_fn_inputs:
        datum = Datum.model_construct(
            model_input=datum.model_input, loss_fn_inputs={k: TensorData.coerce(k, v) for k, v in shared_inputs.items()}
        )
    return datum


def check_datums(
    data: Any,
    loss_fn: str,
    *,
    shared_inputs: Mapping[str, Any] | None = None,
    encode: Callable[[str], list[int]] | None = None,
    vocab_size: int | None = None,
) -> tuple[Datum, ...]:
    """Coerce every accepted datum form and check keys, dtypes and lengths for ``loss_fn``."""
    if isinstance(data, (Datum, Mapping)):
        data = [data]
    if not isinstance(data, Sequence) or isinstance(data, (str, bytes)) or len(data) == 0:
        raise InvalidInputError("expected a non-empty list of datums", field="data", fix="pass list[Datum]")
    if all(isinstance(t, int) for t in data):  # a single token list (SageMaker)
        data = [data]
    required, optional = LOSS_INPUTS[loss_fn]
    out = []
    for i, item in enumerate(data):
        d = _coerce_datum(i, item, shared_inputs, encode)
        n = d.model_input.length
        if n == 0:
            raise InvalidInputError("model_input is empty", field=f"data[{i}].model_input", fix="give at least one token")
        keys = set(d.loss_fn_inputs)
        missing = required - keys
        if missing:
            raise InvalidInputError(
                f"{loss_fn} needs {', '.join(sorted(missing))}",
                field=f"data[{i}].loss_fn_inputs",
                fix=f"add {', '.join(sorted(missing))} with one value per input token ({n})",
            )
        extra = keys - required - optional
        if extra:
            raise InvalidInputError(
                f"{loss_fn} does not use {', '.join(sorted(extra))}",
                field=f"data[{i}].loss_fn_inputs",
                fix="remove the key (caller-side masks belong in weights or advantages)",
            )
        for key, tensor in d.loss_fn_inputs.items():
            where = f"data[{i}].loss_fn_inputs[{key!r}]"
            want = "int64" if key in INT_KEYS else "float32" if key in FLOAT_KEYS else tensor.dtype
            if tensor.dtype != want:
                raise InvalidInputError(f"dtype is {tensor.dtype}", field=where, fix=f"use {want}")
            shape = tensor.shape or [len(tensor.data)]
            if len(shape) != 1 or shape[0] != n:
                raise InvalidInputError(
                    f"shape {shape} does not match the {n} input tokens", field=where, fix=f"give one value per input token: shape [{n}]"
                )
            if want == "float32" and not _all_finite_f32(tensor.data):
                raise InvalidInputError("holds NaN, inf or a value beyond float32", field=where, fix="give finite float32 values")
        if vocab_size is not None:
            tokens = d.model_input.to_ints() + list(d.loss_fn_inputs["target_tokens"].data)
            bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise InvalidInputError(
                    f"token id {str(bad)[:20]} is outside the vocabulary [0, {vocab_size})",
                    field=f"data[{i}]",
                    fix=f"use token ids 0..{vocab_size - 1}",
                )
        out.append(d)
    return tuple(out)


def _all_finite_f32(values: Sequence[float] | Sequence[int]) -> bool:
    import numpy as np

    try:
        with np.errstate(over="ignore", invalid="ignore"):
            return bool(np.isfinite(np.asarray(values, dtype=np.float32)).all())
    except (OverflowError, ValueError, TypeError):
        return False


def coerce_prompt(prompt: Any, encode: Callable[[str], list[int]] | None = None, field: str = "prompt") -> list[int]:
    if type(prompt) is list and all(type(t) is int for t in prompt):  # the common case, fast
        tokens = prompt
    elif isinstance(prompt, str):
        if encode is None:
            raise InvalidInputError("text needs a tokenizer", field=field, fix="pass token ids")
        tokens = encode(prompt)
    else:
        try:
            tokens = ModelInput.from_any(prompt).to_ints()
        except (TypeError, ValidationError) as err:
            raise InvalidInputError(str(err).splitlines()[0], field=field, fix="pass ModelInput or list[int]") from None
    if not tokens:
        raise InvalidInputError("is empty", field=field, fix="give at least one token")
    return tokens


def coerce_sampling_params(params: Any) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, Mapping):
        try:
            return SamplingParams.model_validate(params)
        except ValidationError as err:
            e = err.errors()[0]
            raise InvalidInputError(e["msg"], field=f"sampling_params.{'.'.join(map(str, e['loc']))}", fix="see SamplingParams") from None
    raise InvalidInputError(f"got {type(params).__name__}", field="sampling_params", fix="pass SamplingParams(...)")


def coerce_adam_params(params: Any) -> AdamParams:
    if params is None:
        return AdamParams()
    if isinstance(params, AdamParams):
        return params
    if isinstance(params, Mapping):
        try:
            return AdamParams.model_validate(params)
        except ValidationError as err:
            e = err.errors()[0]
            raise InvalidInputError(e["msg"], field=f"adam_params.{'.'.join(map(str, e['loc']))}", fix="see AdamParams") from None
    raise InvalidInputError(f"got {type(params).__name__}", field="adam_params", fix="pass AdamParams(...)")
