"""Checks run in the client before anything is sent: bad input fails here, with the field and the fix.

A rejected op consumes no sequence number, because these run before one is assigned.
"""

from __future__ import annotations

import math
import numbers
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from .errors import ConflictError, InvalidInputError, UnsupportedError
from .types import FLOAT_KEYS, INT_KEYS, AdamParams, Datum, LossInputError, ModelInput, SamplingParams, TensorData, is_number

__all__ = [
    "MAX_SAMPLES",
    "MAX_LOG_RATIO",
    "SAMPLER_LOGPROB_RANGE",
    "LOSS_INPUTS",
    "LOSS_CONFIG_KEYS",
    "check_loss_fn",
    "check_timeout",
    "check_datums",
    "coerce_datums",
    "check_loss_fn_config",
    "coerce_prompt",
    "coerce_sampling_params",
    "coerce_adam_params",
    "check_base_model",
    "check_checkpoint_name",
    "check_overwrite",
    "free_name",
    "split_name_and_description",
    "check_description",
    "check_ttl_seconds",
    "check_lora_rank",
    "check_seed",
    "check_record_stability_info",
    "check_user_metadata",
    "check_session_options",
    "check_count",
    "check_bound",
    "check_target_prompt_logprobs",
    "is_checkpoint_name",
    "all_finite_f32",
]

# loss name -> (required keys, optional keys); the clip bounds may also be given per token
_RL_OPTIONAL = frozenset({"weights"})
_CLIP = frozenset({"clip_low_threshold", "clip_high_threshold"})
LOSS_INPUTS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "cross_entropy": (frozenset({"target_tokens", "weights"}), frozenset()),
    "importance_sampling": (frozenset({"target_tokens", "logprobs", "advantages"}), _RL_OPTIONAL),
    "ppo": (frozenset({"target_tokens", "logprobs", "advantages"}), _RL_OPTIONAL | _CLIP),
    "cispo": (frozenset({"target_tokens", "logprobs", "advantages"}), _RL_OPTIONAL | _CLIP),
    "dro": (frozenset({"target_tokens", "logprobs", "advantages"}), _RL_OPTIONAL),
    "gspo": (frozenset({"target_tokens", "logprobs", "advantages"}), _RL_OPTIONAL | _CLIP | {"sequence_ratio_mask"}),
}
LOSS_CONFIG_KEYS: dict[str, frozenset[str]] = {
    "cross_entropy": frozenset(),
    "importance_sampling": frozenset(),
    "ppo": _CLIP,
    "cispo": _CLIP,
    "gspo": _CLIP,
    "dro": frozenset({"beta"}),
}


def check_loss_fn(loss_fn: str, supported: Sequence[str] | None = None) -> str:
    if isinstance(loss_fn, str) and loss_fn == "stable_reinforce":  # a numpy array's == is an array: no truth value
        raise UnsupportedError("Tinker's stable_reinforce is not offered", field="loss_fn", fix=STABLE_REINFORCE_FIX)
    if not isinstance(loss_fn, str) or loss_fn not in LOSS_INPUTS:  # a list or dict raised TypeError (unhashable)
        raise InvalidInputError(
            f"unknown loss {loss_fn!r:.60}",
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


def _some(names: Iterable[str], show: int = 8) -> str:
    """Up to ``show`` of ``names``, each cut to 60 characters, and how many more: a refusal names what is wrong without
    echoing a request's thousands of keys back."""
    ordered = sorted(names)
    shown = ", ".join(f"{n:.60}" for n in ordered[:show])
    return shown + (f" and {len(ordered) - show} more" if len(ordered) > show else "")


def check_loss_fn_config(loss_fn: str, config: Mapping[str, Any] | None) -> dict[str, float] | None:
    if not config:
        return None
    allowed = LOSS_CONFIG_KEYS[loss_fn]
    out: dict[str, float] = {}
    for key, value in config.items():
        if key not in allowed:
            keys = ", ".join(sorted(allowed)) or "none"
            raise InvalidInputError(
                f"{loss_fn} takes no key {key!r:.60} (it takes: {keys})", field=f"loss_fn_config[{key!r:.60}]", fix="remove it"
            )
        try:
            if not is_number(value):  # float("0.8") or float(True) would hide a bug
                raise TypeError
            out[key] = float(value)
        except (TypeError, ValueError, OverflowError):
            raise InvalidInputError(
                f"{type(value).__name__} {value!r:.40} is not a number", field=f"loss_fn_config[{key!r:.60}]", fix="give a number, e.g. 0.8"
            ) from None
        if not math.isfinite(out[key]):
            raise InvalidInputError(f"{value!r} is not finite", field=f"loss_fn_config[{key!r:.60}]", fix="give a finite number")
    lo, hi = out.get("clip_low_threshold"), out.get("clip_high_threshold")
    if lo is not None and not 0 <= lo <= 1:  # with high ≥ 1 the bounds never cross (SageMaker's rule too)
        raise InvalidInputError("must be in [0, 1]", field="loss_fn_config['clip_low_threshold']", fix="an absolute ratio bound, e.g. 0.8")
    if hi is not None and hi < 1:
        raise InvalidInputError("must be ≥ 1", field="loss_fn_config['clip_high_threshold']", fix="an absolute ratio bound, e.g. 1.2")
    if out.get("beta", 0.0) < 0:
        raise InvalidInputError("must be ≥ 0", field="loss_fn_config['beta']", fix="give a finite number ≥ 0")
    return out


def _coerce_datum(i: int, item: Any, shared_inputs: Mapping[str, TensorData] | None, encode: Callable[[str], list[int]] | None) -> Datum:
    if isinstance(item, Datum):
        datum = item
    elif isinstance(item, Mapping) or hasattr(item, "loss_fn_inputs"):  # a dict, or Tinker's own Datum
        try:
            datum = Datum.model_validate(item)
        except ValidationError as err:
            first = err.errors(include_url=False)[0]
            where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
            cause = (first.get("ctx") or {}).get("error")
            msg = first["msg"].removeprefix("Value error, ")
            if isinstance(cause, LossInputError):
                where = f".loss_fn_inputs[{cause.key!r}]"
                msg = msg.removeprefix(f"loss_fn_inputs[{cause.key!r}]: ")
            raise InvalidInputError(
                msg,
                field=f"data[{i}]{where}",
                fix="pass a Datum or {'model_input': ..., 'loss_fn_inputs': {...}} (or SageMaker's modelInput / lossFnInputs)",
            ) from None
        except TypeError as err:
            raise InvalidInputError(
                str(err).splitlines()[0],
                field=f"data[{i}]",
                fix="pass a Datum or {'model_input': ..., 'loss_fn_inputs': {...}} (or SageMaker's modelInput / lossFnInputs)",
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
        datum = Datum.model_construct(model_input=datum.model_input, loss_fn_inputs=dict(shared_inputs))
    return datum


def coerce_datums(
    data: Any, *, shared_inputs: Mapping[str, Any] | None = None, encode: Callable[[str], list[int]] | None = None
) -> list[Datum]:
    """Every accepted form of a batch (a Datum, a dict, Tinker's Datum, a token list, text) as a non-empty list of Datums."""
    if isinstance(data, (Datum, Mapping)) or hasattr(data, "loss_fn_inputs"):
        data = [data]
    if not isinstance(data, Sequence) or isinstance(data, (str, bytes)) or len(data) == 0:
        shown = "an empty list" if isinstance(data, Sequence) and not isinstance(data, (str, bytes)) else type(data).__name__
        raise InvalidInputError(f"expected a non-empty list of datums, got {shown}", field="data", fix="pass list[Datum]")
    if all(isinstance(t, int) for t in data):  # a single token list (SageMaker)
        data = [data]
    shared = None if not shared_inputs else {str(k): _shared_input(k, v) for k, v in shared_inputs.items()}
    return [_coerce_datum(i, item, shared, encode) for i, item in enumerate(data)]


def _shared_input(key: Any, value: Any) -> TensorData:
    """One of SageMaker's ``loss_fn_inputs`` for every datum, made a tensor once."""
    try:
        return TensorData.coerce(key, value)
    except (TypeError, ValueError, OverflowError) as err:
        msg = str(err).splitlines()[0].removeprefix(f"loss_fn_inputs[{key!r}]: ")
        raise InvalidInputError(msg, field=f"loss_fn_inputs[{key!r:.60}]", fix="a list of numbers, one per input token") from None


def check_datums(
    data: Any,
    loss_fn: str,
    *,
    shared_inputs: Mapping[str, Any] | None = None,
    encode: Callable[[str], list[int]] | None = None,
    vocab_size: int | None = None,
    max_length: int | None = None,
    multi_target: bool = False,
) -> tuple[Datum, ...]:
    """Coerce every accepted datum form and check keys, dtypes and lengths for ``loss_fn``.

    ``multi_target``: the backend takes ``(N, K)`` ``target_tokens`` for this loss (K targets per position, e.g. a
    densified CSR matrix); every other per-token input then has the targets' shape.
    """
    required, optional = LOSS_INPUTS[loss_fn]
    out = []
    for i, d in enumerate(coerce_datums(data, shared_inputs=shared_inputs, encode=encode)):
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
                f"{loss_fn} does not use {_some(extra)}",
                field=f"data[{i}].loss_fn_inputs",
                fix="remove the key (caller-side masks belong in weights or advantages)",
            )
        target = d.loss_fn_inputs.get("target_tokens")
        expected = [n]
        if multi_target and target is not None and target.shape is not None and len(target.shape) == 2 and target.shape[0] == n:
            expected = list(target.shape)
        for key, tensor in d.loss_fn_inputs.items():
            where = f"data[{i}].loss_fn_inputs[{key!r:.60}]"
            want = "int64" if key in INT_KEYS else "float32" if key in FLOAT_KEYS else tensor.dtype
            if tensor.dtype != want:
                raise InvalidInputError(f"dtype is {tensor.dtype}", field=where, fix=f"use {want}")
            shape = tensor.shape or [len(tensor.data)]
            if math.prod(shape) != len(tensor.data):  # a tensor built with model_construct, or edited after it was checked
                raise InvalidInputError(
                    f"shape {shape} holds {math.prod(shape)} values but data has {len(tensor.data)}",
                    field=where,
                    fix="give as many values as the shape holds (TensorData(...) checks this when it is built)",
                )
            if shape != expected:
                also = f" or [{n}, K] for {loss_fn} on this backend" if multi_target and len(expected) == 1 else ""
                raise InvalidInputError(
                    f"shape {shape} does not match the {n} input tokens" + (f" (targets {expected})" if len(expected) == 2 else ""),
                    field=where,
                    fix=f"give one value per target: shape {expected}{also}",
                )
        check_finite(d, i)
        _check_ranges(d, i)
        if max_length is not None and n > max_length:
            raise InvalidInputError(
                f"{n} tokens exceed the model's context of {max_length}", field=f"data[{i}].model_input", fix="shorten it"
            )
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


# A sampler's log-prob is log p ≤ 0: up to 1e-3 above 0 is float noise (exp(1e-3) − 1 = 0.1 % in a ratio); below
# −1e6 is no log-prob (vLLM reports −9999 for −inf, Tinker's top-k filler is −99999). Outside this range the
# importance ratio exp(p − q) overflows and one optim_step turns the weights to NaN.
SAMPLER_LOGPROB_RANGE = (-1e6, 1e-3)
# The losses cap log r = p − q here (r ≤ e^20 ≈ 4.9e8; verl clamps at 20 too), so exp never overflows.
MAX_LOG_RATIO = 20.0
# A per-token weight or advantage past this scales the gradient so far that AdamW's second moment (g², fp32)
# overflows to inf and every later step of that parameter is 0: the weights stop learning for good.
MAX_TOKEN_SCALE = 1e6

# per-token inputs with a physical range: key -> (lowest, highest, rule, fix)
_RANGES = {
    "logprobs": (*SAMPLER_LOGPROB_RANGE, "a sampler log-prob in [-1e6, 0.001]", "send the sampler's log-probs (log p ≤ 0), e.g. -0.7"),
    "weights": (-MAX_TOKEN_SCALE, MAX_TOKEN_SCALE, "in [-1e6, 1e6]", "weights of at most 1e6 in magnitude, e.g. 1 per trained token"),
    "advantages": (-MAX_TOKEN_SCALE, MAX_TOKEN_SCALE, "in [-1e6, 1e6]", "normalised advantages, e.g. the group's rewards centred"),
    "clip_low_threshold": (0.0, 1.0, "in [0, 1]", "absolute ratio bounds, e.g. 0.8"),
    "clip_high_threshold": (1.0, math.inf, "≥ 1", "absolute ratio bounds, e.g. 1.2"),
    "sequence_ratio_mask": (0.0, 1.0, "in [0, 1] (a token's share in the sequence ratio)", "1 for a sampled token, 0 for the prompt"),
}


def _check_ranges(d: Datum, i: int) -> None:
    """Per-token inputs with a physical range stay in it: sampler log-probs, clip bounds obeying the config's
    rules (low ≥ 0, high ≥ 1) so the bounds never cross, and GSPO's sequence-ratio mask (a weighted mean's weights)."""
    for key, (low, high, rule, fix) in _RANGES.items():
        tensor = d.loss_fn_inputs.get(key)
        bad = None if tensor is None else next((v for v in tensor.data if not low <= v <= high), None)
        if bad is not None:
            raise InvalidInputError(f"{bad!r} is not {rule}", field=f"data[{i}].loss_fn_inputs[{key!r:.60}]", fix=fix)


def all_finite_f32(values: Sequence[float] | Sequence[int]) -> bool:
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
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as err:  # a lone surrogate: each tokenizer did something else with it
            raise InvalidInputError(f"not valid Unicode at {err.start}: {err.reason}", field=field, fix="give valid text") from None
        tokens = encode(prompt)
    else:
        try:
            tokens = ModelInput.from_any(prompt).to_ints()
        except TypeError as err:
            raise InvalidInputError(str(err), field=field, fix="pass ModelInput or list[int]") from None
        except ValidationError as err:
            e = err.errors()[0]
            where, msg = ".".join(map(str, e["loc"])), e["msg"].removeprefix("Value error, ")
            raise InvalidInputError(f"{where}: {msg}" if where else msg, field=field, fix="pass ModelInput or list[int]") from None
    if not tokens:
        raise InvalidInputError("is empty", field=field, fix="give at least one token")
    if not 0 <= min(tokens) <= max(tokens) < 2**63:
        bad = next(t for t in tokens if not 0 <= t < 2**63)
        raise InvalidInputError(f"id {bad} is not a token id", field=field, fix="ids in 0..2**63-1")
    return tokens


def _foreign_model(params: Any) -> Any:
    """Another library's pydantic model of the same name (Tinker's ``types.AdamParams``, ...) as its fields."""
    return params.model_dump() if hasattr(params, "model_dump") and not isinstance(params, Mapping) else params


def coerce_sampling_params(params: Any) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    params = _foreign_model(params)
    if isinstance(params, Mapping):
        try:
            return SamplingParams.model_validate(params)
        except ValidationError as err:
            e = err.errors()[0]
            raise InvalidInputError(
                e["msg"].removeprefix("Value error, "), field=f"sampling_params.{'.'.join(map(str, e['loc']))}", fix="see SamplingParams"
            ) from None
    raise InvalidInputError(f"got {type(params).__name__}", field="sampling_params", fix="pass SamplingParams(...)")


def coerce_adam_params(params: Any) -> AdamParams:
    if params is None:
        return AdamParams()
    if isinstance(params, AdamParams):
        return params
    params = _foreign_model(params)
    if isinstance(params, Mapping):
        try:
            return AdamParams.model_validate(params)
        except ValidationError as err:
            e = err.errors()[0]
            raise InvalidInputError(
                e["msg"].removeprefix("Value error, "), field=f"adam_params.{'.'.join(map(str, e['loc']))}", fix="see AdamParams"
            ) from None
    raise InvalidInputError(f"got {type(params).__name__}", field="adam_params", fix="pass AdamParams(...)")


# ------------------------------------------------------------------ names, descriptions, metadata

_CHECKPOINT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_NAME_FIX = "1-128 of A-Z a-z 0-9 . _ - starting with a letter or digit (free text goes in description=)"
MAX_TOPK = 1024  # alternatives per position for top-k log-probs
MAX_DESCRIPTION = 1024  # SageMaker's limit on a model package description
MAX_METADATA_ITEMS = 64
MAX_SAMPLES = 1000  # samples one request may ask for
MAX_METADATA_CHARS = 1024
_SESSION_NAME = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}")  # SageMaker's TrainingSessionName


def is_checkpoint_name(name: object) -> bool:
    """True when ``name`` can be a checkpoint's path component."""
    return isinstance(name, str) and _CHECKPOINT_NAME.fullmatch(name) is not None and ".." not in name


def check_checkpoint_name(name: Any, field: str = "name") -> str:
    if not is_checkpoint_name(name):
        shown = repr(name) if not isinstance(name, str) or len(name) <= 80 else repr(name[:80]) + "..."
        raise InvalidInputError(f"{shown} is not a checkpoint name", field=field, fix=_NAME_FIX)
    return name  # type: ignore[no-any-return]


def check_overwrite(name: str, taken: bool, overwrite: bool) -> None:
    """A save under ``name`` where a checkpoint already is: a :class:`ConflictError` naming ``overwrite``,
    unless ``overwrite`` is set (then the save replaces it). The client (names it saved) and the in-process
    backends (names they hold) refuse it before numbering."""
    if taken and not overwrite:
        raise ConflictError(
            f"a checkpoint named {name!r} already exists", field="overwrite", fix="pass overwrite=True to replace it, or pick another name"
        )


def free_name(base: str, taken: Callable[[str], bool]) -> str:
    """``base``, or the first free of ``base-2``, ``base-3``, ...: the name a backend picks for an unnamed save, so
    that an earlier save the user named ``base`` never makes it refuse."""
    name, k = base, 1
    while taken(name):
        k += 1
        name = f"{base}-{k}"
    return name


def _check_text(value: Any, field: str, limit: int) -> str:
    if not isinstance(value, str):
        raise InvalidInputError(f"got {type(value).__name__}", field=field, fix="pass a str")
    if len(value) > limit:
        raise InvalidInputError(f"is {len(value)} characters long", field=field, fix=f"keep it to {limit} characters")
    if "\x00" in value:
        raise InvalidInputError("contains a NUL character", field=field, fix="remove the \\x00")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInputError("is not valid Unicode (a lone surrogate?)", field=field, fix="pass UTF-8-encodable text") from None
    return value


def check_base_model(base_model: Any, field: str = "base_model") -> str:
    """A base model's name: 1-512 characters of valid Unicode, not blank, no NUL."""
    if not isinstance(base_model, str) or not base_model.strip() or len(base_model) > 512 or "\x00" in base_model:
        raise InvalidInputError(
            f"{base_model!r:.80} is not a model name", field=field, fix="e.g. 'Qwen/Qwen3-0.6B' or see list_base_models()"
        )
    try:
        base_model.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInputError("is not valid Unicode", field=field, fix="see list_base_models()") from None
    return base_model


def check_checkpoint_path(path: Any, field: str = "path") -> str:
    """A checkpoint's path as a save result gives it (``scheme://...`` or an ARN), as bounded, clean text."""
    fix = "pass the .path of a save_state/save_weights result"
    if not isinstance(path, str) or ("://" not in path and not path.startswith("arn:")):
        shown = repr(path) if not isinstance(path, str) or len(path) <= 80 else repr(path[:80]) + "..."
        raise InvalidInputError(f"{shown} is not a checkpoint path", field=field, fix=fix)
    _check_text(path, field, 4096)
    if any(ord(c) < 32 for c in path):
        raise InvalidInputError("contains control characters", field=field, fix=fix)
    return path


def check_description(description: Any, field: str = "description") -> str | None:
    """Free text (≤1024 characters, valid Unicode, no NUL); ``None`` and ``""`` mean none."""
    if description is None or description == "":
        return None
    return _check_text(description, field, MAX_DESCRIPTION)


def split_name_and_description(name: Any, description: Any) -> tuple[str | None, str | None]:
    """Both anchors' ``save_state`` first argument: Tinker's ``name`` or SageMaker's ``description``.

    A first argument that is a valid checkpoint name is the name; any other text is SageMaker's free-text
    description (the backend then names the checkpoint). ``description=`` is always the description, and
    with it the first argument must be a valid name.
    """
    desc = check_description(description)
    if name is None or name == "":
        return None, desc
    if is_checkpoint_name(name):
        return name, desc
    if desc is None and isinstance(name, str):
        return None, check_description(name, field="name (taken as SageMaker's description)")
    return check_checkpoint_name(name), desc


def check_ttl_seconds(ttl: Any) -> int | None:
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1 or ttl > 10 * 366 * 86400:
        raise InvalidInputError(f"{ttl!r:.40} is not a lifetime in seconds", field="ttl_seconds", fix="an int in 1..316224000, or None")
    return ttl


def check_timeout(timeout: Any, field: str = "timeout", fix: str = "give seconds >= 0, or None to wait without a limit") -> float | None:
    """A wait's limit in seconds: ``None``, ``inf`` or anything from ``threading.TIMEOUT_MAX`` (~292 years) up (no limit,
    returned as ``None``: a thread's wait refuses a longer one with ``OverflowError``), else a number >= 0."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout != timeout or timeout < 0:  # != : NaN
        raise InvalidInputError(f"{timeout!r:.40} is not a number of seconds >= 0", field=field, fix=fix)
    return None if timeout >= threading.TIMEOUT_MAX else float(timeout)


def check_lora_rank(rank: Any, field: str = "rank") -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= 1024:
        raise InvalidInputError(f"{rank!r:.40} is not a LoRA rank", field=field, fix="an int in 1..1024, e.g. rank=32")
    return rank


def check_seed(seed: Any, field: str = "seed") -> int | None:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise InvalidInputError(f"{seed!r:.40} is not a seed", field=field, fix="an int in 0..2**63-1, or None")
    return seed


STABLE_REINFORCE_FIX = (
    "leave record_stability_info False and train on the sampler's log-probs with ppo, cispo or importance_sampling: "
    "Tinker's stable_reinforce (the one use of the records) is not public, so asyncsess does not offer it"
)


def check_record_stability_info(value: Any) -> bool:
    """Tinker's ``record_stability_info``: only ``False`` (or ``None``). Its records feed ``stable_reinforce``, whose
    objective and records are not public (spec: losses §2.7), so ``True`` is refused rather than ignored."""
    if value is None or value is False:
        return False
    if value is True:
        raise UnsupportedError("stability records are not kept here", field="record_stability_info", fix=STABLE_REINFORCE_FIX)
    raise InvalidInputError(f"got {value!r:.40}", field="record_stability_info", fix="True or False")


def check_user_metadata(meta: Any, field: str = "user_metadata") -> dict[str, str]:
    """A small ``dict[str, str]`` (≤64 items of ≤1024 characters each)."""
    if meta is None:
        return {}
    if not isinstance(meta, Mapping):
        raise InvalidInputError(f"got {type(meta).__name__}", field=field, fix="pass a dict of str to str")
    if len(meta) > MAX_METADATA_ITEMS:
        raise InvalidInputError(f"has {len(meta)} items", field=field, fix=f"keep it to {MAX_METADATA_ITEMS}")
    out: dict[str, str] = {}
    for k, v in meta.items():
        key = _check_text(k, f"{field} key", MAX_METADATA_CHARS)
        if not key:
            raise InvalidInputError("empty key", field=field, fix="name every item")
        out[key] = _check_text(v, f"{field}[{key!r}]", MAX_METADATA_CHARS)
    return out


def check_session_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """SageMaker's per-call session options; ``None`` values are dropped."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        if value is None:
            continue
        if key == "training_session_name":
            if not isinstance(value, str) or not _SESSION_NAME.fullmatch(value):
                raise InvalidInputError(
                    f"{value!r} is not a session name",
                    field=key,
                    fix="1-63 of a-z A-Z 0-9 and -, starting and ending with a letter or digit",
                )
        elif key in ("model_package_group_arn", "kms_key_arn"):
            _check_text(value, key, 2048)
            if not value.startswith("arn:"):
                raise InvalidInputError(f"{value!r} is not an ARN", field=key, fix="pass arn:aws:...")
        elif key == "s3_output_path":
            _check_text(value, key, 1024)
            if not value.startswith("s3://") or len(value) <= 5:
                raise InvalidInputError(f"{value!r} is not an S3 URI", field=key, fix="pass s3://bucket/prefix")
        elif key == "vpc_config":
            if not isinstance(value, Mapping) or not {"Subnets", "SecurityGroupIds"} <= set(value):
                raise InvalidInputError(
                    "needs Subnets and SecurityGroupIds", field=key, fix="{'Subnets': [...], 'SecurityGroupIds': [...]}"
                )
            value = {k: list(v) for k, v in value.items()}
        elif key == "optimizer":
            kind = value.get("type") if isinstance(value, Mapping) else getattr(value, "type", None)
            if kind not in ("adam", "adamw", None):
                raise UnsupportedError(f"optimizer {kind!r} is not offered", field=key, fix="use AdamW (the default)")
            value = "adamw"
        out[key] = value
    return out


def check_count(value: Any, field: str, *, low: int = 0, high: int = 10_000, none_ok: bool = False) -> Any:
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # numpy's ints are counts too (pydantic takes them)
        raise InvalidInputError(f"{value!r:.40} is not a whole number", field=field, fix=f"an int in {low}..{high}")
    if not low <= int(value) <= high:
        raise InvalidInputError(f"{value!r:.40} is out of range", field=field, fix=f"an int in {low}..{high}")
    return int(value)


def check_bound(value: Any, field: str) -> int:
    """A client's bound (requests or bytes in flight, datums or bytes per chunk): a whole number >= 1. With 0 a sampling
    pool admitted nothing, and every ``sample`` waited forever."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InvalidInputError(f"{value!r:.40} is not a whole number >= 1", field=field, fix=f"give {field} >= 1, or leave the default")
    return int(value)


def check_target_prompt_logprobs(target: Any, prompt_len: int) -> tuple[tuple[int, ...], ...] | None:
    """Tinker's ``target_prompt_logprobs``: int ids of shape ``[len(prompt) - 1, K]``, ``-1`` = skip; a one-token
    prompt has no row to score and is refused."""
    if target is None:
        return None
    if prompt_len < 2:  # [0, K] asks for nothing (mock:// and local:// crashed on it); its rows cannot say K for an empty answer
        raise InvalidInputError(
            f"a prompt of {prompt_len} token(s) has no position to score (position 0 has no preceding context)",
            field="target_prompt_logprobs",
            fix="send a prompt of 2 or more tokens, or leave target_prompt_logprobs out",
        )
    cells = _declared_cells(target, (prompt_len - 1) * MAX_TOPK)
    if cells > (prompt_len - 1) * MAX_TOPK:  # before the per-cell checks, which a few MB of ids kept busy for seconds
        raise InvalidInputError(
            f"{cells} cells for a prompt of {prompt_len} tokens",
            field="target_prompt_logprobs",
            fix=f"int64 of shape [{prompt_len - 1}, K] with 1 <= K <= {MAX_TOPK}",
        )
    try:
        tensor = _csr_target(target) or TensorData.coerce("target_prompt_logprobs", target)
    except (TypeError, ValueError, OverflowError, ValidationError) as err:  # 10**400 among floats: float() overflows
        raise InvalidInputError(
            str(err).splitlines()[0], field="target_prompt_logprobs", fix="an int64 tensor [len(prompt) - 1, K]"
        ) from None
    shape = tensor.shape or [len(tensor.data)]
    if tensor.dtype != "int64" or len(shape) != 2 or shape[0] != prompt_len - 1 or not 1 <= shape[1] <= MAX_TOPK:
        raise InvalidInputError(
            f"dtype {tensor.dtype}, shape {shape}",
            field="target_prompt_logprobs",
            fix=f"int64 of shape [{prompt_len - 1}, K] with 1 <= K <= {MAX_TOPK}",
        )
    k = shape[1]
    rows = tuple(tuple(int(x) for x in tensor.data[i * k : (i + 1) * k]) for i in range(shape[0]))
    if any(not -1 <= x < 2**63 for row in rows for x in row):  # past int64: an OverflowError when the backend ran it
        raise InvalidInputError("ids must be int64 >= 0, or -1 to skip a cell", field="target_prompt_logprobs")
    return rows


def _declared_cells(target: Any, limit: int) -> int:
    """The most cells ``target`` claims or holds, counted without reading them: its declared shape (a CSR one
    densifies to it), its ``data``, or its rows' lengths (rows are counted only up to ``limit`` of them)."""
    shape = target.get("shape") if isinstance(target, dict) else getattr(target, "shape", None)
    declared = math.prod(shape) if isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape) else 0
    data = target.get("data") if isinstance(target, dict) else target
    if not isinstance(data, (list, tuple)):
        return declared
    if len(data) > limit:
        return len(data)
    return max(declared, len(data), sum(len(r) for r in data if isinstance(r, (list, tuple))))


def _csr_target(target: Any) -> TensorData | None:
    """A CSR ``target_prompt_logprobs`` (Tinker's ``TensorData`` or its JSON) made dense with ``-1`` (skip) in its
    unlisted cells, as Tinker reads it (``from_torch_sparse(ids, pad_value=-1)`` sends only the cells it names);
    None when ``target`` is not CSR."""
    names = ("data", "dtype", "shape", "sparse_crow_indices", "sparse_col_indices")
    fields = {k: target.get(k) if isinstance(target, dict) else getattr(target, k, None) for k in names}
    if fields["sparse_crow_indices"] is None and fields["sparse_col_indices"] is None:
        return None
    data: Any = fields["data"]
    shifted = [int(v) + 1 for v in (data.tolist() if hasattr(data, "tolist") else list(data or []))]  # unlisted cells: 0 ...
    dense = TensorData.model_validate({**fields, "data": shifted, "dtype": "int64"})
    return dense.model_copy(update={"data": [v - 1 for v in dense.data], "dtype": fields["dtype"]})  # ... then -1


def check_finite(d: Datum, i: int) -> None:
    """Float loss inputs must be finite in float32; token ids must be non-negative int64."""
    for key, tensor in d.loss_fn_inputs.items():
        if tensor.dtype == "float32":
            if not all_finite_f32(tensor.data):
                raise InvalidInputError(
                    "holds NaN, inf or a value beyond float32",
                    field=f"data[{i}].loss_fn_inputs[{key!r:.60}]",
                    fix="give finite float32 values",
                )
        else:
            bad = next((v for v in tensor.data if _not_an_id(v)), None)
            if bad is not None:
                raise InvalidInputError(
                    f"id {bad!r:.40} is not a token id", field=f"data[{i}].loss_fn_inputs[{key!r:.60}]", fix="whole numbers in 0..2**63-1"
                )
    bad = next((t for t in d.model_input.to_ints() if _not_an_id(t)), None)
    if bad is not None:
        raise InvalidInputError(f"id {bad!r:.40} is not a token id", field=f"data[{i}].model_input", fix="whole numbers in 0..2**63-1")


def _not_an_id(v: Any) -> bool:
    """Not a whole number in int64's range: a float such as 40.5 in a tensor built with model_construct (or edited
    after its check) was truncated to 40 by the backend, a bool read as 1."""
    if type(v) is not int and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
        return True
    return not 0 <= int(v) < 2**63
