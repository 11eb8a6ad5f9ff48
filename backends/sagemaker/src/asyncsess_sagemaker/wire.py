"""asyncsess types <-> the runtime's JSON, and the rules the service states in prose, written once.

The driver uses the ``*_to_wire`` / ``*_from_wire`` pairs in one direction and the emulator in the other,
so the two cannot drift apart. The rules the service model states only in its documentation (supported
``lossFnInputs`` keys, the keys each loss requires, the ``lossFnConfig`` keys and ranges) are read from
that documentation, not copied.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from asyncsess.types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    ModelInput,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    TensorData,
    Usage,
)
from asyncsess.validation import LOSS_CONFIG_KEYS, MAX_TOKEN_SCALE, SAMPLER_LOGPROB_RANGE, all_finite_f32

from .arns import parse_model_package_arn
from .service_models import CONTROL, RUNTIME, enum_values, operation, runtime_model
from .shape_check import ShapeError, check_shape

__all__ = [
    "WIRE_LOSSES",
    "LossRules",
    "loss_rules",
    "check_operation_config",
    "check_sample_config",
    "model_input_to_wire",
    "model_input_from_wire",
    "tensor_to_wire",
    "tensor_from_wire",
    "datum_to_wire",
    "datum_from_wire",
    "adam_to_wire",
    "adam_from_wire",
    "sampling_params_to_wire",
    "sampling_params_from_wire",
    "forward_result_to_wire",
    "forward_result_from_wire",
    "sample_response_to_wire",
    "sample_response_from_wire",
    "logprobs_to_wire",
    "logprobs_from_wire",
    "SDK_ADAM_DEFAULTS",
]

WIRE_LOSSES: tuple[str, ...] = enum_values(RUNTIME, "LossFnName")

# What the service does with an omitted optional AdamParamsConfig member is unpublished; the emulator
# uses the official SDK's defaults (which the SDK always sends).
SDK_ADAM_DEFAULTS = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weightDecay": 0.01}

_CODE = re.compile(r"<code>([^<]+)</code>")


class LossRules:
    """The ``lossFnInputs`` / ``lossFnConfig`` rules, parsed from the service model's documentation."""

    def __init__(self) -> None:
        shapes = runtime_model()._shape_resolver._shape_map  # the raw model keeps member documentation
        doc = shapes["Datum"]["members"]["lossFnInputs"]["documentation"]
        supported, required = doc.split("Required keys", 1)
        self.supported_keys: frozenset[str] = frozenset(_CODE.findall(supported.split("Supported keys:", 1)[1]))
        self.required_keys: dict[str, frozenset[str]] = {}
        for losses, keys in re.findall(r"\(([^)]*)\) requires (.*?)(?:;|</p>|\.\s)", required):
            for loss in _CODE.findall(losses):
                self.required_keys[loss] = frozenset(_CODE.findall(keys))
        cfg_doc = shapes["ForwardBackwardConfig"]["members"]["lossFnConfig"]["documentation"]
        self.config_ranges: dict[str, tuple[float, float]] = {
            key: (float(lo), float(hi)) for key, lo, hi in re.findall(r"<code>(\w+)</code> \(valid range: ([\d.]+) to ([\d.]+)\)", cfg_doc)
        }
        missing = set(WIRE_LOSSES) - set(self.required_keys)
        if not self.supported_keys or missing or not self.config_ranges:
            raise RuntimeError(f"could not read the loss rules from the service model documentation (no rules for {missing})")


@lru_cache(maxsize=1)
def loss_rules() -> LossRules:
    return LossRules()


# ----------------------------------------------------------------------------------- semantics


def _model_input_length(mi: dict[str, Any]) -> int:
    return sum(len(c.get("tokens") or []) for c in mi.get("chunks") or [])


def _check_datums(config: dict[str, Any], path: str, vocab_size: int | None, context: int | None) -> None:
    rules = loss_rules()
    loss = config["lossFnName"]
    datums = config["datumList"]
    if not datums:
        raise ShapeError(f"{path}.datumList", "Member must contain at least one datum", datums)
    for i, datum in enumerate(datums):
        where = f"{path}.datumList[{i}]"
        n = _model_input_length(datum["modelInput"])
        if not datum["modelInput"]["chunks"] or n == 0:
            raise ShapeError(f"{where}.modelInput", "Member must have at least one chunk with at least one token", datum["modelInput"])
        _check_context(n, context, f"{where}.modelInput")
        inputs = datum.get("lossFnInputs") or {}
        unsupported = sorted(set(inputs) - rules.supported_keys)
        if unsupported:
            raise ShapeError(
                f"{where}.lossFnInputs",
                f"Unsupported key {unsupported[0]!r}; supported keys: {', '.join(sorted(rules.supported_keys))}",
                sorted(inputs),
            )
        missing = sorted(rules.required_keys[loss] - set(inputs))
        if missing:
            raise ShapeError(
                f"{where}.lossFnInputs",
                f"{loss} requires {', '.join(sorted(rules.required_keys[loss]))}; missing {', '.join(missing)}",
                sorted(inputs),
            )
        for key, tensor in inputs.items():
            tpath = f"{where}.lossFnInputs[{key!r}]"
            data = tensor["data"]
            if tensor["dtype"] not in ("int64", "float32"):
                raise ShapeError(f"{tpath}.dtype", "Member must be int64 or float32", tensor["dtype"])
            if not isinstance(data, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in data):
                raise ShapeError(f"{tpath}.data", "Member must be a flat list of numbers", data)
            if tensor["dtype"] == "int64" and not all(isinstance(v, int) or float(v).is_integer() for v in data):
                raise ShapeError(f"{tpath}.data", "int64 data must hold integers", data)
            if key == "target_tokens" and not all(isinstance(v, int) or float(v).is_integer() for v in data):
                # a float32 1.7 was taken as token 1: the engines cast targets to integers
                raise ShapeError(f"{tpath}.data", "target_tokens must hold token ids (whole numbers)", data)
            if tensor["dtype"] == "int64" and not all(-(2**63) <= int(v) < 2**63 for v in data):
                raise ShapeError(f"{tpath}.data", "int64 data must fit in 64 bits", data)
            if tensor["dtype"] == "float32" and not all_finite_f32(data):
                raise ShapeError(f"{tpath}.data", "float32 data must be finite (no NaN, no Infinity) and within float32", data)
            low, high = SAMPLER_LOGPROB_RANGE
            if key == "logprobs" and not all(low <= v <= high for v in data):
                raise ShapeError(f"{tpath}.data", f"sampler log-probs must be in [{low:g}, {high:g}] (log p ≤ 0)", data)
            if key in ("weights", "advantages") and not all(abs(v) <= MAX_TOKEN_SCALE for v in data):
                raise ShapeError(f"{tpath}.data", f"{key} must be in [-{MAX_TOKEN_SCALE:g}, {MAX_TOKEN_SCALE:g}]", data)
            shape = tensor.get("shape")
            if shape is not None and shape != [n]:  # the engine takes one value per input token, nothing else
                raise ShapeError(
                    f"{tpath}.shape", f"Member must be [{n}], one value per input token (flatten a batch dimension such as [1, {n}])", shape
                )
            if len(data) != n:
                raise ShapeError(f"{tpath}.data", f"Member must hold one value per input token ({n})", len(data))
        if vocab_size is not None:
            tokens = [t for c in datum["modelInput"]["chunks"] for t in c["tokens"]]
            tokens += [int(t) for t in (inputs.get("target_tokens") or {}).get("data", [])]
            bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ShapeError(where, f"token id must be in [0, {vocab_size})", bad)
    key_sets = sorted({tuple(sorted(d.get("lossFnInputs") or {})) for d in datums})
    if len(key_sets) > 1:  # the engine takes a key on every datum or on none
        raise ShapeError(f"{path}.datumList", "Member must give every datum the same lossFnInputs keys", key_sets)
    cfg = config.get("lossFnConfig")
    if cfg is not None:
        if not isinstance(cfg, dict):
            raise ShapeError(f"{path}.lossFnConfig", "Member must be an object", cfg)
        for key, value in cfg.items():
            if key not in rules.config_ranges:
                raise ShapeError(
                    f"{path}.lossFnConfig", f"Unsupported key {key!r}; supported keys: {', '.join(sorted(rules.config_ranges))}", key
                )
            lo, hi = rules.config_ranges[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
                raise ShapeError(f"{path}.lossFnConfig.{key}", f"Member must be a number in [{lo:g}, {hi:g}]", value)
            if key not in LOSS_CONFIG_KEYS[loss]:  # clip thresholds bound a ratio: cross_entropy and importance_sampling have none
                raise ShapeError(f"{path}.lossFnConfig", f"{loss} takes no key {key!r}; only ppo and cispo take clip thresholds", key)


def _check_package_arn(arn: str, path: str) -> None:
    if parse_model_package_arn(arn) is None:
        raise ShapeError(
            path, "Member must be a model package version ARN (arn:aws:sagemaker:REGION:ACCOUNT:model-package/NAME/VERSION)", arn
        )


def _check_context(n: int, context: int | None, path: str) -> None:
    if context is not None and n > context:
        raise ShapeError(path, f"Member must hold at most {context} tokens (the model's context length)", n)


def check_operation_config(config: dict[str, Any], vocab_size: int | None = None, context: int | None = None) -> None:
    """The prose rules of ``OperationConfig`` (run after the shape check); ``vocab_size`` and ``context`` (the
    model's context length in tokens) are checked when known."""
    kind, body = next(iter(config.items()))
    path = f"operationConfig.{kind}"
    if kind in ("forward", "forwardBackward"):
        _check_datums(body, path, vocab_size, context)
    elif kind == "optimizerStep":
        if body["adamParamsConfig"]["learningRate"] <= 0:
            raise ShapeError(
                f"{path}.adamParamsConfig.learningRate", "Member must be greater than 0", body["adamParamsConfig"]["learningRate"]
            )
    elif kind == "loadState":
        _check_package_arn(body["modelPackageArn"], f"{path}.modelPackageArn")
    elif body.get("description") is not None:  # saveState, saveWeights
        # it becomes the package's ModelPackageDescription, whose control-plane pattern refuses NUL, newlines, ...
        member = operation(CONTROL, "DescribeModelPackage").output_shape.members["ModelPackageDescription"]
        check_shape(body["description"], member, f"{path}.description")


def check_sample_config(config: dict[str, Any], vocab_size: int | None = None, context: int | None = None) -> None:
    """The prose rules of ``SampleOperationConfig`` (run after the shape check), as :func:`check_operation_config`."""
    kind, body = next(iter(config.items()))
    path = f"operationConfig.{kind}"
    if body.get("modelPackageArn") is not None:
        _check_package_arn(body["modelPackageArn"], f"{path}.modelPackageArn")
    if "prompt" in body:
        tokens = [t for c in body["prompt"]["chunks"] for t in c["tokens"]]
        if not tokens:
            raise ShapeError(f"{path}.prompt", "Member must hold at least one token", body["prompt"])
        _check_context(len(tokens), context, f"{path}.prompt")
        if vocab_size is not None:
            bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ShapeError(f"{path}.prompt", f"token id must be in [0, {vocab_size})", bad)
    if kind == "sample":
        try:
            sampling_params_from_wire(body["samplingParams"])
        except ValueError as err:  # pydantic's ValidationError: a seed, top_k or stop string the sampler refuses
            raise ShapeError(f"{path}.samplingParams", _first_error(err), body["samplingParams"]) from None


def _first_error(err: ValueError) -> str:
    errors = getattr(err, "errors", None)
    if not callable(errors) or not errors():
        return str(err)
    first = errors()[0]
    return f"{'.'.join(str(x) for x in first['loc'])}: {first['msg']}"


# ---------------------------------------------------------------------------------- conversions


def model_input_to_wire(mi: ModelInput | list[int] | tuple[int, ...]) -> dict[str, Any]:
    chunks = mi.chunks if isinstance(mi, ModelInput) else [EncodedTextChunk.model_construct(tokens=list(mi), type="encoded_text")]
    return {"chunks": [{"tokens": [int(t) for t in c.tokens], "type": "encoded_text"} for c in chunks]}


def model_input_from_wire(wire: dict[str, Any]) -> ModelInput:
    return ModelInput.model_construct(
        chunks=[EncodedTextChunk.model_construct(tokens=list(c["tokens"]), type="encoded_text") for c in wire["chunks"]]
    )


def tensor_to_wire(tensor: TensorData) -> dict[str, Any]:
    out: dict[str, Any] = {"data": list(tensor.data), "dtype": tensor.dtype}
    out["shape"] = list(tensor.shape) if tensor.shape is not None else [len(tensor.data)]
    return out


def tensor_from_wire(wire: dict[str, Any]) -> TensorData:
    dtype = wire["dtype"]
    data = [int(v) for v in wire["data"]] if dtype == "int64" else [float(v) for v in wire["data"]]
    return TensorData.model_construct(data=data, dtype=dtype, shape=list(wire["shape"]) if wire.get("shape") is not None else None)


def datum_to_wire(datum: Datum, fill_weights: bool = False) -> dict[str, Any]:
    """``fill_weights`` adds all-ones ``weights`` when absent (Tinker's RL losses do not take them; the wire needs them)."""
    inputs = {k: tensor_to_wire(v) for k, v in datum.loss_fn_inputs.items()}
    if fill_weights and "weights" not in inputs:
        n = datum.model_input.length
        inputs["weights"] = {"data": [1.0] * n, "dtype": "float32", "shape": [n]}
    out: dict[str, Any] = {"modelInput": model_input_to_wire(datum.model_input)}
    if inputs:
        out["lossFnInputs"] = inputs
    return out


def datum_from_wire(wire: dict[str, Any]) -> Datum:
    return Datum.model_construct(
        model_input=model_input_from_wire(wire["modelInput"]),
        loss_fn_inputs={k: tensor_from_wire(v) for k, v in (wire.get("lossFnInputs") or {}).items()},
    )


def adam_to_wire(params: AdamParams) -> dict[str, Any]:
    out: dict[str, Any] = {
        "learningRate": params.learning_rate,
        "beta1": params.beta1,
        "beta2": params.beta2,
        "eps": params.eps,
        "weightDecay": params.weight_decay,
    }
    if params.grad_clip_norm > 0:  # 0 means off in asyncsess; the wire spells off by omission
        out["gradClipNorm"] = params.grad_clip_norm
    if params.lora_plus_lr_ratio is not None:
        out["loraPlusLrRatio"] = params.lora_plus_lr_ratio
    return out


def adam_from_wire(wire: dict[str, Any]) -> AdamParams:
    merged = {**SDK_ADAM_DEFAULTS, **wire}
    return AdamParams.model_construct(
        learning_rate=merged["learningRate"],
        beta1=merged["beta1"],
        beta2=merged["beta2"],
        eps=merged["eps"],
        weight_decay=merged["weightDecay"],
        grad_clip_norm=merged.get("gradClipNorm", 0.0),
        lora_plus_lr_ratio=merged.get("loraPlusLrRatio"),
    )


def sampling_params_to_wire(params: SamplingParams, max_tokens: int) -> dict[str, Any]:
    """``max_tokens`` is the wire value (the caller raises short requests to the wire minimum)."""
    out: dict[str, Any] = {"maxTokens": max_tokens, "temperature": params.temperature, "topP": params.top_p}
    if params.top_k != -1:
        out["topK"] = params.top_k
    if params.seed is not None:
        out["seed"] = params.seed
    stops = params.stop_strings()
    if stops:
        out["stop"] = stops
    return out


def sampling_params_from_wire(wire: dict[str, Any]) -> SamplingParams:
    return SamplingParams.model_validate(
        {
            "max_tokens": wire["maxTokens"],
            "temperature": wire.get("temperature"),
            "top_p": wire.get("topP") or None,  # the wire allows 0; asyncsess needs > 0
            "top_k": wire.get("topK"),
            "seed": wire.get("seed"),
            "stop": wire.get("stop"),
        }
    )


def forward_result_to_wire(out: ForwardBackwardOutput, training_tokens: int) -> dict[str, Any]:
    return {
        "lossFnOutputType": out.loss_fn_output_type or "TensorData",
        "lossFnOutputs": [{k: tensor_to_wire(v) for k, v in d.items()} for d in out.loss_fn_outputs],
        "metrics": {k: float(v) for k, v in out.metrics.items()},
        "tokenUsage": {"trainingTokens": training_tokens},
    }


def forward_result_from_wire(wire: dict[str, Any], op_token_usage: dict[str, Any] | None = None) -> ForwardBackwardOutput:
    usage = wire.get("tokenUsage") or op_token_usage or {}
    return ForwardBackwardOutput.model_construct(
        loss_fn_output_type=wire.get("lossFnOutputType") or "",
        loss_fn_outputs=[{k: tensor_from_wire(v) for k, v in d.items()} for d in wire.get("lossFnOutputs") or []],
        metrics=dict(wire.get("metrics") or {}),
        usage=Usage.model_construct(training_tokens=int(usage.get("trainingTokens") or 0), prefill_tokens=0, decode_tokens=0),
    )


def logprobs_to_wire(values: list[float | None]) -> list[float | None]:
    """One entry per prompt token; the first (no context) is ``null``.

    The official SDK rejects a ``computeLogprobs`` result whose length differs from the prompt's and
    types the entries ``Optional[float]``; botocore parses ``null`` in a ``DoubleList`` as ``None``.
    """
    return [None if v is None else float(v) for v in values]


def logprobs_from_wire(values: list[float | None], prompt_length: int) -> list[float | None]:
    """One entry per prompt token; a list one shorter (the first token left out) gets a leading ``None``."""
    out: list[float | None] = list(values)
    if len(out) == prompt_length - 1:
        out.insert(0, None)
    return out


def sample_response_to_wire(resp: SampleResponse, prompt_length: int, include_prompt_logprobs: bool) -> dict[str, Any]:
    seqs = []
    for s in resp.sequences:
        item: dict[str, Any] = {
            "stopReason": s.stop_reason,
            "tokens": list(s.tokens),
            "tokenUsage": {"prefill": prompt_length, "decode": len(s.tokens)},
        }
        if s.logprobs is not None:
            item["logprobs"] = [float(v) for v in s.logprobs]
        seqs.append(item)
    out: dict[str, Any] = {"sequences": seqs}
    if include_prompt_logprobs and resp.prompt_logprobs is not None:
        # Numbers only: the official SDK types a sample's promptLogprobs List[float] (a computeLogprobs result
        # Optional[float]) and refuses a null, so the first token (no context) is left out, as
        # logprobs_from_wire expects.
        lps = logprobs_to_wire(resp.prompt_logprobs)
        out["promptLogprobs"] = lps[1:] if lps and lps[0] is None else lps
    if resp.topk_prompt_logprobs is not None:  # list<list<TokenLogprob>>; [] where a position was not scored
        out["topkPromptLogprobs"] = [[{"tokenId": t, "logprob": float(lp)} for t, lp in row or []] for row in resp.topk_prompt_logprobs]
    return out


def sample_response_from_wire(wire: dict[str, Any], prompt_length: int, max_tokens: int | None, operation_id: str) -> SampleResponse:
    """``max_tokens`` below the wire minimum is enforced here: longer sequences are cut and marked ``length``. Each
    sequence is named ``"<operation_id>:<i>"`` (the wire names none), as the other backends name theirs."""
    seqs = []
    total = Usage()
    for i, s in enumerate(wire["sequences"]):
        tokens, logprobs, reason = list(s["tokens"]), s.get("logprobs"), s["stopReason"]
        if max_tokens is not None and len(tokens) > max_tokens:
            tokens, reason = tokens[:max_tokens], "length"
            logprobs = logprobs[:max_tokens] if logprobs is not None else None
        tu = s.get("tokenUsage") or {}
        usage = Usage.model_construct(
            training_tokens=0, prefill_tokens=int(tu.get("prefill") or 0), decode_tokens=int(tu.get("decode") or 0)
        )
        total = total + usage
        seqs.append(
            SampledSequence.model_construct(
                stop_reason=reason, tokens=tokens, logprobs=logprobs, sequence_id=f"{operation_id}:{i}", usage=usage
            )
        )
    prompt_lp = wire.get("promptLogprobs")
    topk = wire.get("topkPromptLogprobs")
    return SampleResponse.model_construct(
        sequences=seqs,
        prompt_logprobs=logprobs_from_wire(prompt_lp, prompt_length) if prompt_lp is not None else None,
        usage=total,
        topk_prompt_logprobs=[[(int(x["tokenId"]), float(x["logprob"])) for x in row] or None for row in topk]
        if topk is not None
        else None,
    )
