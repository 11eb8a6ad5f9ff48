"""Wire types: defined once and shared by the client, the mock, the worker and the emulators.

Names and fields follow the anchors (Tinker and SageMaker training sessions). Where the two take
different forms, both are accepted: a prompt may be a ``ModelInput`` or a ``list[int]``, a checkpoint
result has both ``.path`` and ``.model_package_arn``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from enum import Enum
from typing import Annotated, Any, Literal, NamedTuple, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from .errors import InputValidationError

__all__ = [
    "EncodedTextChunk",
    "ModelInput",
    "TensorData",
    "TensorDtype",
    "PromptProvenanceSpan",
    "SampledProvenanceSpan",
    "ProvenanceSpan",
    "Datum",
    "LossFnType",
    "LOSS_FUNCTIONS",
    "SamplingParams",
    "AdamParams",
    "Usage",
    "ForwardBackwardOutput",
    "OptimStepResponse",
    "SampledSequence",
    "SampleResponse",
    "CheckpointResponse",
    "SaveStateResponse",
    "SaveWeightsResponse",
    "SaveWeightsForSamplerResponse",
    "LoadWeightsResponse",
    "LoadStateResponse",
    "Checkpoint",
    "ModelPackageInfo",
    "ModelPackageDeletion",
    "SessionSummary",
    "TrainingSessionSummary",
    "TrainingRun",
    "Cursor",
    "CheckpointsListResponse",
    "TrainingRunsResponse",
    "TokenLogprob",
    "TopkLogprobs",
    "TopkArrays",
    "SupportedModel",
    "ServerCapabilities",
    "GetInfoResponse",
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False, arbitrary_types_allowed=False)


# --------------------------------------------------------------------------------------- inputs


class _Input(_Model):
    """An input type: a value it refuses when built raises :class:`~asyncsess.errors.InputValidationError`, an
    ``InvalidInputError`` naming the field (as every other check of ours), which is still a pydantic ``ValidationError``."""

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except InputValidationError:
            raise
        except ValidationError as err:
            raise InputValidationError.of(err) from None


def is_number(v: Any) -> bool:
    """An int or float (numpy's included), not a bool and not text: lax coercion of ``"0.8"`` or ``True`` hides bugs."""
    t = type(v)
    return t is float or t is int or (isinstance(v, numbers.Real) and not isinstance(v, bool))


def _first_non_number(values: Sequence[Any]) -> int | None:
    """The index of the first item of ``values`` that is not a number, or None."""
    for i, v in enumerate(values):
        t = type(v)
        if t is not float and t is not int and not is_number(v):
            return i
    return None


def _shown(v: Any) -> str:
    return f"{type(v).__name__} {v!r:.40}"


class EncodedTextChunk(_Input):
    """A run of token ids."""

    tokens: list[int]
    type: Literal["encoded_text"] = "encoded_text"

    @field_validator("tokens", mode="before")
    @classmethod
    def _ints_only(cls, v: Any) -> Any:
        """A bool or a str is not a token id (pydantic's lax mode would read ``True`` as id 1, ``"7"`` as 7)."""
        if isinstance(v, (list, tuple)):
            bad = _first_non_number(v)
            if bad is not None:
                raise ValueError(f"tokens[{bad}] is {_shown(v[bad])}: a token id is an int")
        return v

    @property
    def length(self) -> int:
        return len(self.tokens)


class ModelInput(_Input):
    """A sequence of chunks fed to the model. Only text chunks are supported."""

    chunks: list[EncodedTextChunk] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _prompt(cls, values: Any) -> Any:
        """SageMaker's ``ModelInput(prompt=[...])``: a token list instead of chunks."""
        if isinstance(values, dict) and "prompt" in values:
            if "chunks" in values:
                raise ValueError("give chunks or prompt, not both")
            return {"chunks": [{"tokens": list(values["prompt"])}]}
        if isinstance(values, dict) and isinstance(values.get("chunks"), (list, tuple)):
            for i, chunk in enumerate(values["chunks"]):
                kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else "encoded_text"
                if kind != "encoded_text":  # Tinker's image, image_asset_pointer and dmel chunks
                    raise ValueError(f"chunks[{i}] has type {kind!r:.40}: only token chunks (encoded_text) are supported")
        return values

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> ModelInput:
        ints = list(tokens) if all(type(t) is int for t in tokens) else [int(t) for t in tokens]
        return cls.model_construct(chunks=[EncodedTextChunk.model_construct(tokens=ints, type="encoded_text")])

    @classmethod
    def empty(cls) -> ModelInput:
        return cls.model_construct(chunks=[])

    @classmethod
    def from_any(cls, value: Any) -> ModelInput:
        """Coerce every prompt form the anchors accept (except ``str``, which needs a tokenizer)."""
        if isinstance(value, ModelInput):
            return value
        if isinstance(value, EncodedTextChunk):
            return cls.model_construct(chunks=[value])
        if hasattr(value, "keys") and "input_ids" in value.keys() and "chunks" not in value.keys():
            return cls.from_any(value["input_ids"])  # a tokenizer's output (apply_chat_template's BatchEncoding)
        if isinstance(value, dict):
            if "prompt" in value and "chunks" not in value:
                return cls.from_any(value["prompt"])
            return cls.model_validate(value)
        if hasattr(value, "chunks") and not isinstance(value, (str, bytes)):
            return cls.model_validate({"chunks": [_chunk_dict(c) for c in value.chunks]})
        if getattr(value, "is_meta", False):
            raise TypeError("a tensor on the meta device holds no token ids; pass one on the CPU or a GPU")
        if hasattr(value, "tolist"):
            value = value.tolist()
        if isinstance(value, list) and all(type(t) is int for t in value):  # the common case, fast
            return cls.from_ints(value)
        if isinstance(value, (list, tuple)):
            bad = next((t for t in value if isinstance(t, bool) or not (isinstance(t, int) or hasattr(t, "__index__"))), value)
            if bad is not value and isinstance(bad, (list, tuple)):
                raise TypeError(f"a batch of {len(value)} token lists is not one prompt; pass one sequence (input_ids[0])")
            if bad is not value:
                raise TypeError(f"a prompt given as a list must hold token ids (ints), not {_shown(bad)}")
            return cls.from_ints([int(t) for t in value])
        raise TypeError(f"cannot make a ModelInput from {type(value).__name__}; pass list[int] or ModelInput")

    @property
    def prompt(self) -> list[int]:
        """SageMaker's ``prompt`` spelling: the token ids (``ModelInput(prompt=[...])`` is accepted on input)."""
        return self.to_ints()

    def to_ints(self) -> list[int]:
        out: list[int] = []
        for c in self.chunks:
            out.extend(c.tokens)
        return out

    @property
    def length(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)

    def append(self, chunk: EncodedTextChunk) -> ModelInput:
        return ModelInput.model_construct(chunks=[*self.chunks, chunk])

    def append_int(self, token: int) -> ModelInput:
        return self.append(EncodedTextChunk.model_construct(tokens=[int(token)], type="encoded_text"))


def _chunk_dict(chunk: Any) -> Any:
    """Another library's chunk (Tinker's) as a dict: its tokens, or its ``type`` when it has none (an image)."""
    if isinstance(chunk, dict):
        return chunk
    if not hasattr(chunk, "tokens"):
        return {"type": str(getattr(chunk, "type", type(chunk).__name__))}
    return {"tokens": list(chunk.tokens)}


# Keys whose lists are coerced to a fixed dtype (both anchors' tables).
INT_KEYS = frozenset({"target_tokens"})
FLOAT_KEYS = frozenset(
    {
        "weights",
        "advantages",
        "logprobs",
        "old_logprobs",
        "ref_log_prob",
        "temperature",
        "clip_low_threshold",
        "clip_high_threshold",
        "sequence_ratio_mask",
    }
)


CSR_PAD_VALUE = 0  # what Tinker's TensorData.to_numpy()/to_torch() put in a CSR tensor's unlisted cells
MAX_SPANS = 4096  # provenance spans per Datum field
MAX_SPAN_INDEX = 2**31 - 1


_TENSOR_FIELDS = ("data", "dtype", "shape", "sparse_crow_indices", "sparse_col_indices")
_DATUM_FIELDS = ("model_input", "loss_fn_inputs", "model_input_spans", "loss_fn_input_spans")
_WIRE_DATUM_KEYS = (("modelInput", "model_input"), ("lossFnInputs", "loss_fn_inputs"))


class TensorDtype(str, Enum):
    """SageMaker's dtype names (Tinker's are the strings themselves). ``int32``, ``float16`` and ``bfloat16`` are taken
    and widened without loss to ``int64`` and ``float32``, the two dtypes a tensor holds."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    INT32 = "int32"
    INT64 = "int64"


_WIDER_DTYPE = {"float32": "float32", "float16": "float32", "bfloat16": "float32", "int32": "int64", "int64": "int64"}


class TensorData(_Input):
    """A flat tensor with dtype and shape (row-major). ``dtype`` defaults to ``float32`` (SageMaker's default) and takes
    a :class:`TensorDtype` member or its string.

    Tinker's sparse CSR form (``data`` holds the listed values, ``sparse_crow_indices`` the ``rows + 1`` row
    pointers, ``sparse_col_indices`` one column per value, ``shape`` the dense ``[rows, cols]``) is accepted and
    densified on construction, with ``0`` (Tinker's default ``pad_value``) in every unlisted cell, so every
    backend sees dense data and both index fields read ``None`` afterwards.
    """

    data: list[float] | list[int]
    dtype: Literal["int64", "float32"] = "float32"
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_name(cls, v: Any) -> Any:
        name = v.value if isinstance(v, TensorDtype) else v
        return _WIDER_DTYPE.get(name, name) if isinstance(name, str) else v

    @field_validator("data", "shape", "sparse_crow_indices", "sparse_col_indices", mode="before")
    @classmethod
    def _numbers_only(cls, v: Any, info: Any) -> Any:
        if isinstance(v, (list, tuple)):
            bad = _first_non_number(v)
            if bad is not None:
                raise ValueError(f"{info.field_name}[{bad}] is {_shown(v[bad])}, not a number")
        return v

    @model_validator(mode="after")
    def _check_shape(self) -> TensorData:
        if self.dtype == "int64":
            self.data = _whole_numbers(self.data)
        if self.sparse_crow_indices is not None or self.sparse_col_indices is not None:
            self._densify()
        if self.shape is not None:
            n = 1
            for s in self.shape:
                n *= s
            if n != len(self.data):
                raise ValueError(f"shape {self.shape} holds {n} values but data has {len(self.data)}")
        return self

    def _densify(self) -> None:
        crow, col, shape = self.sparse_crow_indices, self.sparse_col_indices, self.shape
        if crow is None or col is None:
            raise ValueError("sparse_crow_indices and sparse_col_indices come together: set both or neither")
        if shape is None or len(shape) != 2 or min(shape) < 0:
            raise ValueError(f"a CSR tensor needs shape [rows, cols], got {shape}")
        rows, cols = shape
        if rows * cols > 2**26:
            raise ValueError(f"shape {shape} densifies to {rows * cols} cells; at most {2**26}")
        if len(crow) != rows + 1 or crow[0] != 0 or crow[-1] != len(col):
            raise ValueError(f"sparse_crow_indices must have rows + 1 = {rows + 1} entries from 0 to len(sparse_col_indices) = {len(col)}")
        if any(b < a for a, b in zip(crow, crow[1:])):
            raise ValueError("sparse_crow_indices must be non-decreasing")
        if len(self.data) != len(col):
            raise ValueError(f"data has {len(self.data)} values but sparse_col_indices has {len(col)}; give one value per column index")
        dense: list[Any] = [CSR_PAD_VALUE if self.dtype == "int64" else float(CSR_PAD_VALUE)] * (rows * cols)
        for r in range(rows):
            seen: set[int] = set()
            for k in range(crow[r], crow[r + 1]):
                c = col[k]
                if not 0 <= c < cols or c in seen:
                    raise ValueError(f"sparse_col_indices[{k}] = {c} is out of range [0, {cols}) or repeated in row {r}")
                seen.add(c)
                dense[r * cols + c] = self.data[k]
        self.data = dense
        self.sparse_crow_indices = self.sparse_col_indices = None

    @classmethod
    def from_list(cls, values: Sequence[Any], dtype: Literal["int64", "float32"] | None = None) -> TensorData:
        vals = list(values)
        bad = _first_non_number(vals)
        if bad is not None:
            raise TypeError(f"item {bad} is {_shown(vals[bad])}, not a number")
        if dtype is None:
            dtype = "int64" if all(isinstance(v, int) and not isinstance(v, bool) for v in vals) else "float32"
        data = _whole_numbers(vals) if dtype == "int64" else [float(v) for v in vals]
        return cls.model_construct(data=data, dtype=dtype, shape=[len(data)])

    @classmethod
    def from_numpy(cls, array: Any, dtype: Literal["int64", "float32"] | None = None) -> TensorData:
        import numpy as np

        arr = np.asarray(array)
        if arr.dtype.kind not in "iuf":  # bool, text, object, complex: numpy's astype would coerce them silently
            raise TypeError(f"an array of {arr.dtype} is not numbers; pass ints or floats")
        if dtype is None:
            dtype = "int64" if np.issubdtype(arr.dtype, np.integer) else "float32"
        if dtype == "int64" and np.issubdtype(arr.dtype, np.integer):  # as Python ints: a uint64 past int64 read as -1
            return cls.model_construct(data=arr.ravel().tolist(), dtype=dtype, shape=list(arr.shape))
        np_dtype = np.int64 if dtype == "int64" else np.float32
        if dtype == "int64" and arr.dtype.kind in "fc" and not np.all(np.isfinite(arr) & (arr == np.round(arr))):
            raise ValueError("int64 data (token ids) must hold whole numbers: a float with a fraction would be truncated")
        return cls.model_construct(data=arr.astype(np_dtype).ravel().tolist(), dtype=dtype, shape=list(arr.shape))

    @classmethod
    def from_torch(cls, tensor: Any, dtype: Literal["int64", "float32"] | None = None) -> TensorData:
        if tensor.is_meta:
            raise TypeError("a tensor on the meta device holds no values; pass one on the CPU or a GPU")
        if tensor.is_complex() or str(tensor.dtype) == "torch.bool":
            raise TypeError(f"a {tensor.dtype} tensor is not real numbers; pass ints or floats")
        t = tensor.detach().cpu()
        if str(t.layout) != "torch.strided":  # sparse: the values it stands for
            t = t.to_dense()
        if t.is_floating_point():
            t = t.float()  # bfloat16 and float16 included
        return cls.from_numpy(t.numpy(), dtype)

    @classmethod
    def coerce(cls, key: str, value: Any) -> TensorData:
        """Build from a list, numpy array, torch tensor or TensorData, with the anchors' per-key dtype."""
        dtype: Literal["int64", "float32"] | None = "int64" if key in INT_KEYS else "float32" if key in FLOAT_KEYS else None
        if isinstance(value, TensorData):
            if dtype is not None and value.dtype != dtype:
                return cls.from_list(value.data, dtype).model_copy(update={"shape": value.shape or [len(value.data)]})
            return value
        if isinstance(value, dict):
            return cls.coerce(key, cls.model_validate(value))
        if hasattr(value, "sparse_crow_indices") and hasattr(value, "dtype"):  # Tinker's TensorData (a dataclass)
            return cls.coerce(key, {f: getattr(value, f) for f in _TENSOR_FIELDS})
        if type(value).__module__.startswith("torch"):
            return cls.from_torch(value, dtype)
        if hasattr(value, "__array__") and not isinstance(value, (list, tuple)):
            return cls.from_numpy(value, dtype)
        if isinstance(value, (list, tuple)):
            if value and isinstance(value[0], (list, tuple)):
                for row in value:  # numpy would read a bool in a row as 1 and text as a str array
                    bad = _first_non_number(row) if isinstance(row, (list, tuple)) else None
                    if bad is not None:
                        raise TypeError(f"loss_fn_inputs[{key!r}]: item {bad} of a row is {_shown(row[bad])}, not a number")
                return cls.from_numpy(value, dtype)
            return cls.from_list(value, dtype)
        raise TypeError(f"loss_fn_inputs[{key!r}]: cannot make a tensor from {type(value).__name__}")

    def tolist(self) -> list[float] | list[int]:
        return list(self.data)

    def to_numpy(self) -> Any:
        import numpy as np

        arr = np.asarray(self.data, dtype=np.int64 if self.dtype == "int64" else np.float32)
        return arr.reshape(self.shape) if self.shape else arr

    def to_torch(self) -> Any:
        import torch

        return torch.from_numpy(self.to_numpy())


class _ProvenanceSpan(_Input):
    sequence_id: str = Field(min_length=1, max_length=256, pattern=r"^[^\x00]*$")
    offset: int = Field(0, ge=0, le=MAX_SPAN_INDEX)
    length: int = Field(ge=0, le=MAX_SPAN_INDEX)


class PromptProvenanceSpan(_ProvenanceSpan):
    """A run of datum positions that are ``[offset, offset + length)`` of sequence ``sequence_id``'s prompt (Tinker)."""

    kind: Literal["prompt"] = "prompt"


class SampledProvenanceSpan(_ProvenanceSpan):
    """A run of datum positions that are ``[offset, offset + length)`` of sequence ``sequence_id``'s sampled tokens."""

    kind: Literal["sampled"] = "sampled"


ProvenanceSpan = Annotated[PromptProvenanceSpan | SampledProvenanceSpan, Field(discriminator="kind")]


class Datum(_Input):
    """One training example: model input plus named per-token tensors for the loss.

    ``model_input_spans`` / ``loss_fn_input_spans`` are Tinker's optional provenance: runs tiling the input
    tokens and ``target_tokens``, set both or neither. They are checked (at most 4096 runs each) and carried,
    and change nothing in training.
    """

    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = Field(default_factory=dict)
    model_input_spans: list[ProvenanceSpan] | None = Field(None, max_length=MAX_SPANS)
    loss_fn_input_spans: list[ProvenanceSpan] | None = Field(None, max_length=MAX_SPANS)

    @model_validator(mode="after")
    def _spans_pair(self) -> Datum:
        if (self.model_input_spans is None) != (self.loss_fn_input_spans is None):
            raise ValueError("provenance comes as a pair: set both model_input_spans and loss_fn_input_spans, or neither")
        return self

    def with_provenance(self, model_input: Sequence[ProvenanceSpan], loss_fn_inputs: Sequence[ProvenanceSpan]) -> Datum:
        """A copy carrying provenance; each list's lengths must sum to its field's length (Tinker's check)."""
        _check_tiling("model_input", model_input, self.model_input.length)
        target = self.loss_fn_inputs.get("target_tokens")
        if target is not None and (target.shape is None or len(target.shape) == 1):
            _check_tiling("loss_fn_inputs", loss_fn_inputs, len(target.data))
        return Datum.model_validate({**dict(self), "model_input_spans": list(model_input), "loss_fn_input_spans": list(loss_fn_inputs)})

    @property
    def prompt(self) -> ModelInput:
        """SageMaker's ``prompt`` spelling of ``model_input`` (``Datum(prompt=...)`` is accepted on input)."""
        return self.model_input

    @model_validator(mode="before")
    @classmethod
    def _coerce(cls, values: Any) -> Any:
        if not isinstance(values, (dict, Datum)) and hasattr(values, "loss_fn_inputs"):  # Tinker's Datum (a dataclass)
            values = {f: getattr(values, f, None) for f in _DATUM_FIELDS}
        if isinstance(values, dict):
            values = dict(values)
            for wire, name in _WIRE_DATUM_KEYS:  # SageMaker's wire form, which its SDK takes as a datum too
                if wire in values and name not in values:
                    values[name] = values.pop(wire)
            if "prompt" in values and "model_input" not in values:
                values["model_input"] = values.pop("prompt")
            mi = values.get("model_input")
            if mi is not None and not isinstance(mi, ModelInput):
                values["model_input"] = ModelInput.from_any(mi)
            for key in ("model_input_spans", "loss_fn_input_spans"):
                if isinstance(values.get(key), (list, tuple)):
                    values[key] = [_span_dict(span) for span in values[key]]
            lfi = values.get("loss_fn_inputs")
            if lfi:
                values["loss_fn_inputs"] = {k: _coerce_named(k, v) for k, v in lfi.items()}
        return values


def _whole_numbers(values: Sequence[Any]) -> list[int]:
    """``values`` as ints: whole numbers only (``6.0`` is 6; ``6.5``, NaN, ±inf and bools are refused, never truncated)."""
    out = []
    for v in values:
        if isinstance(v, numbers.Integral) and not isinstance(v, bool):
            out.append(int(v))
        elif isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and float(v).is_integer():
            out.append(int(float(v)))
        else:
            raise ValueError(f"int64 data (token ids) must hold whole numbers, not {str(v)[:20]}")
    return out


class LossInputError(ValueError):
    """A ``loss_fn_inputs`` value that makes no tensor; ``key`` names it (pydantic drops a nested model's location)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"loss_fn_inputs[{key!r}]: {message.removeprefix(f'loss_fn_inputs[{key!r}]: ')}")
        self.key = key


def _coerce_named(key: str, value: Any) -> TensorData:
    try:
        return TensorData.coerce(key, value)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        raise LossInputError(key, first["msg"].removeprefix("Value error, ")) from None
    except (TypeError, ValueError, OverflowError) as err:
        raise LossInputError(key, str(err).splitlines()[0]) from None


def _span_dict(span: Any) -> Any:
    """Take Tinker's span dataclasses (no ``kind`` field: the class says it) as well as dicts and our models."""
    if isinstance(span, (dict, _ProvenanceSpan)) or not hasattr(span, "sequence_id"):
        return span
    kind = "sampled" if "Sampled" in type(span).__name__ else "prompt"
    return {"kind": kind, "sequence_id": span.sequence_id, "offset": getattr(span, "offset", 0), "length": getattr(span, "length", None)}


def _check_tiling(kwarg: str, spans: Sequence[ProvenanceSpan], expected: int) -> None:
    total = sum(span.length for span in spans)
    if total != expected:
        raise ValueError(
            f"with_provenance {kwarg} spans cover {total} positions but the field has {expected}; the runs must tile it exactly"
        )


LossFnType = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"]
LOSS_FUNCTIONS: tuple[str, ...] = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")


MAX_SEED = 2**63 - 1  # seeds are 0..MAX_SEED (a torch generator's range)
MAX_STOPS = 64  # stop strings or token ids per request
MAX_STOP_CHARS = 1000  # characters per stop string
MAX_TOKENS = 2**31 - 1  # new tokens one request may ask for: past a 32-bit int (2**70, say) it reached the backend as it came


def _a_number(v: Any) -> Any:
    """A number field refuses True/False and text (pydantic's lax mode would read them as 1, 0 and ``float("0.8")``)."""
    if v is not None and not is_number(v):
        raise ValueError(f"{_shown(v)} is not a number")
    return v


class SamplingParams(_Input):
    """Decoding parameters. Defaults follow Tinker; ``max_tokens=None`` means the backend's limit.

    ``stop=None`` keeps the implicit end-of-sequence stop; ``stop=[]`` disables every stop, EOS included.
    Numbers must be finite numbers (not bools, not text); a stop string must be non-empty; ``seed`` is in ``0..2**63-1``.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1
    stop: str | list[str | int] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_items(cls, v: Any) -> Any:
        """A stop is a string or a token id: ``True`` or ``1.0`` was read as a stop at token id 1."""
        for s in v if isinstance(v, (list, tuple)) else ():
            if not isinstance(s, str) and (isinstance(s, bool) or not isinstance(s, numbers.Integral)):
                raise ValueError(f"a stop is a string or a token id (int), not {_shown(s)}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str | int] | None) -> str | list[str | int] | None:
        items = [v] if isinstance(v, str) else v or []
        if len(items) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings or token ids")
        for s in items:
            if isinstance(s, str) and not 0 < len(s) <= MAX_STOP_CHARS:
                raise ValueError(f"a stop string must have 1..{MAX_STOP_CHARS} characters (use stop=[] for no stop)")
            if isinstance(s, str) and not s.isascii():
                try:
                    s.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError("a stop string must be valid Unicode (no lone surrogates)") from None
        return v

    _numbers_only = field_validator("max_tokens", "temperature", "top_p", "top_k", "seed", mode="before")(_a_number)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (disabled) or a positive count")
        return v

    @field_validator("temperature", mode="before")
    @classmethod
    def _temperature_none(cls, v: Any) -> Any:
        return 1.0 if v is None else v  # SageMaker spells "server default" as None

    @field_validator("top_p", mode="before")
    @classmethod
    def _top_p_none(cls, v: Any) -> Any:
        return 1.0 if v is None else v

    @field_validator("top_k", mode="before")
    @classmethod
    def _top_k_none(cls, v: Any) -> Any:
        return -1 if v is None else v

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            return [self.stop]
        return [s for s in self.stop if isinstance(s, str)]

    def stop_token_ids(self) -> list[int]:
        if isinstance(self.stop, list):
            return [s for s in self.stop if isinstance(s, int)]
        return []


MAX_LEARNING_RATE = 10.0
MIN_ADAM_EPS = 1.1754943508222875e-38
"""float32's smallest normal number: the optimizer state is float32, where a smaller eps is 0 (or a subnormal, which a
GPU kernel may flush to 0), and a parameter with a zero gradient (every LoRA A before B has moved) got 0 / 0 = NaN."""


class AdamParams(_Input):
    """AdamW settings for one ``optim_step``. Defaults follow Tinker (β2 0.95, eps 1e-12, no decay, no clip).

    Every number must be a finite number (a bool or text is refused); ``learning_rate`` is in ``[0, 10]``, ``eps`` in
    ``[MIN_ADAM_EPS, 1]``, ``weight_decay`` in ``[0, 1]``, ``lora_plus_lr_ratio`` in ``[1, 1000]``, and
    ``learning_rate · lora_plus_lr_ratio · weight_decay ≤ 1`` and ``learning_rate · lora_plus_lr_ratio ≤ 10`` (LoRA B's rate). Decoupled decay multiplies each weight by ``1 − learning_rate ·
    weight_decay`` per step (LoRA B's by ``1 − learning_rate · lora_plus_lr_ratio · weight_decay``): past 1 it flips their
    sign, past 2 it grows them each step until they overflow to inf and the session's weights are NaN.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    learning_rate: float = Field(default=1e-4, ge=0.0, le=MAX_LEARNING_RATE)
    beta1: float = Field(default=0.9, ge=0.0, lt=1.0)
    beta2: float = Field(default=0.95, ge=0.0, lt=1.0)
    eps: float = Field(default=1e-12, gt=0.0, le=1.0)
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0)
    grad_clip_norm: float = Field(default=0.0, ge=0.0)
    lora_plus_lr_ratio: float | None = Field(default=None, ge=1.0, le=1000.0)

    _numbers_only = field_validator("*", mode="before")(_a_number)

    @field_validator("grad_clip_norm", mode="before")
    @classmethod
    def _clip_none(cls, v: Any) -> Any:
        return 0.0 if v is None else v  # SageMaker spells "off" as None

    @field_validator("eps")
    @classmethod
    def _eps_in_float32(cls, v: float) -> float:
        if v < MIN_ADAM_EPS:
            raise ValueError(
                f"{v:.3g} is below 1.18e-38, float32's smallest normal number (the optimizer's state is float32); use e.g. 1e-12"
            )
        return v

    @field_validator("weight_decay", "lora_plus_lr_ratio")
    @classmethod
    def _decay_shrinks(cls, v: float | None, info: ValidationInfo) -> float | None:
        """Decoupled decay multiplies a weight by ``1 − lr × weight_decay`` per step, LoRA B's by ``1 − lr × ratio ×
        weight_decay``: the factor must stay in [0, 1] (past 1 it flips their sign, past 2 it grows them to inf)."""
        lr, decay = info.data.get("learning_rate"), info.data.get("weight_decay", v)
        scale = v if info.field_name == "lora_plus_lr_ratio" else 1.0
        if isinstance(lr, (int, float)) and isinstance(decay, (int, float)) and isinstance(scale, (int, float)) and lr * scale * decay > 1:
            names = "learning_rate × lora_plus_lr_ratio × weight_decay" if scale != 1.0 else "learning_rate × weight_decay"
            raise ValueError(
                f"{names} is {lr * scale * decay:.3g}; it must be at most 1 (decoupled decay multiplies each weight by 1 − "
                "that product per step: past 1 it flips their sign, past 2 it grows them to inf)"
            )
        if (
            info.field_name == "lora_plus_lr_ratio"
            and isinstance(lr, (int, float))
            and isinstance(v, (int, float))
            and lr * v > MAX_LEARNING_RATE
        ):
            raise ValueError(
                f"learning_rate × lora_plus_lr_ratio is {lr * v:.3g}, LoRA B's learning rate; it must be at most {MAX_LEARNING_RATE:g}, "
                "the largest learning_rate taken: lower either (LoRA+ uses ratios around 16)"
            )
        return v


# -------------------------------------------------------------------------------------- outputs


class _Output(_Model):
    """An output type: a field it does not know (one a newer server added) is ignored, so that an older client
    keeps reading a newer server's answers; a known field of the wrong type is still refused."""

    model_config = ConfigDict(extra="ignore")


class Usage(_Output):
    """Tokens an operation consumed (SageMaker's ``tokenUsage``; Tinker's billing buckets)."""

    training_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage.model_construct(
            training_tokens=self.training_tokens + other.training_tokens,
            prefill_tokens=self.prefill_tokens + other.prefill_tokens,
            decode_tokens=self.decode_tokens + other.decode_tokens,
        )

    @property
    def total_tokens(self) -> int:
        return self.training_tokens + self.prefill_tokens + self.decode_tokens


class ForwardBackwardOutput(_Output):
    """Per-datum outputs (``logprobs``) and metrics; the loss is ``metrics["loss:sum"]``."""

    loss_fn_output_type: str = ""
    loss_fn_outputs: list[dict[str, TensorData]] = Field(default_factory=list)
    metrics: dict[str, float] = Field(default_factory=dict)
    usage: Usage = Field(default_factory=Usage)

    @property
    def loss(self) -> float:
        """``metrics["loss:sum"]`` (the anchors' docs print ``result.loss``)."""
        return self.metrics["loss:sum"]


class OptimStepResponse(_Output):
    metrics: dict[str, float] | None = None
    step: int = 0


TopkLogprobs = list[list[tuple[int, float]] | None]
"""Per position, the ``(token_id, logprob)`` pairs of the k most likely tokens, most likely first (``None``: not scored)."""


class TokenLogprob(_Output):
    """SageMaker's ``(token_id, logprob)`` record."""

    token_id: int
    logprob: float


class TopkArrays(NamedTuple):
    """Tinker's ``TopkLogprobs``: dense ``(L, k)`` ids (int32) and log-probs (float32); unscored cells are 0 / -99999."""

    token_ids: Any
    logprobs: Any


def _topk_arrays(rows: TopkLogprobs | None) -> TopkArrays | None:
    if rows is None:
        return None
    import numpy as np

    k = max((len(r) for r in rows if r), default=0)
    ids = np.zeros((len(rows), k), dtype=np.int32)
    lps = np.full((len(rows), k), -99999.0, dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (t, lp) in enumerate(row or []):
            ids[i, j], lps[i, j] = t, lp
    return TopkArrays(ids, lps)


class SampledSequence(_Output):
    stop_reason: Literal["length", "stop"]
    tokens: list[int]
    logprobs: list[float] | None = None
    sequence_id: str | None = None
    usage: Usage = Field(default_factory=Usage)
    topk_logprobs: TopkLogprobs | None = None  # one entry per sampled token when topk_sample_logprobs > 0

    @property
    def tokens_np(self) -> Any:
        import numpy as np

        return np.asarray(self.tokens, dtype=np.int32)

    @property
    def logprobs_np(self) -> Any:
        import numpy as np

        return None if self.logprobs is None else np.asarray(self.logprobs, dtype=np.float32)

    @property
    def topk_logprobs_np(self) -> TopkArrays | None:
        return _topk_arrays(self.topk_logprobs)


class SampleResponse(_Output):
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    usage: Usage = Field(default_factory=Usage)
    topk_prompt_logprobs: TopkLogprobs | None = None  # one entry per prompt token (the first is None)
    target_prompt_logprobs: TensorData | None = None  # float32 [len(prompt)-1, K]; 0.0 where the id was -1
    prompt_cache_hit_tokens: int = 0

    @property
    def prompt_logprobs_np(self) -> Any:
        """float32 array, NaN where a position was not scored."""
        import numpy as np

        if self.prompt_logprobs is None:
            return None
        return np.asarray([np.nan if v is None else v for v in self.prompt_logprobs], dtype=np.float32)

    @property
    def topk_prompt_logprobs_np(self) -> TopkArrays | None:
        return _topk_arrays(self.topk_prompt_logprobs)


CheckpointKind = Literal["state", "sampler", "merged"]


class CheckpointResponse(_Output):
    """Where a save landed. ``path`` is a URI the client can pass back (Tinker ``path``, SageMaker ARN)."""

    path: str
    kind: CheckpointKind = "state"
    step: int = 0

    @property
    def model_package_arn(self) -> str:
        return self.path

    @property
    def type(self) -> str:
        """Tinker's response tag: ``save_weights`` for state, ``save_weights_for_sampler`` for sampler weights."""
        return "save_weights" if self.kind == "state" else "save_weights_for_sampler"


# Both anchors' names for the one result type (they swap the meaning of SaveWeightsResponse).
SaveStateResponse = CheckpointResponse
SaveWeightsResponse = CheckpointResponse
SaveWeightsForSamplerResponse = CheckpointResponse


class LoadWeightsResponse(_Output):
    path: str
    step: int = 0


LoadStateResponse = LoadWeightsResponse


class Checkpoint(_Output):
    """A saved checkpoint (Tinker's ``Checkpoint``; SageMaker's ``ModelPackageInfo`` via the aliases)."""

    checkpoint_id: str
    checkpoint_type: Literal["training", "sampler", "merged"]
    path: str
    time: float
    step: int = 0
    size_bytes: int | None = None
    description: str | None = None
    user_metadata: dict[str, str] | None = None
    expires_at: float | None = None
    public: bool = False

    @property
    def version(self) -> int | None:
        """SageMaker's model package version: the ARN's last component, when it is a number."""
        tail = self.path.rsplit("/", 1)[-1]
        return int(tail) if tail.isdigit() else None

    @property
    def tinker_path(self) -> str:
        return self.path

    @property
    def model_package_arn(self) -> str:
        return self.path

    @property
    def kind(self) -> str:
        """SageMaker's ``ModelPackageKind``: ``CHECKPOINT`` (resumable state) or ``MODEL``."""
        return "CHECKPOINT" if self.checkpoint_type == "training" else "MODEL"

    @property
    def creation_time(self) -> float:
        return self.time


ModelPackageInfo = Checkpoint


class ModelPackageDeletion(_Output):
    """SageMaker's answer to ``delete_model_package``: whether this call deleted the package (``False``: it was already
    gone) and whether its artifacts were kept (``sagemaker://`` keeps the S3 objects; ``mock://`` and ``local://``
    delete the files with the record)."""

    model_package_arn: str
    model_package_deleted: bool
    s3_uri: str | None = None
    objects_deleted: int = 0
    artifacts_retained: bool = True
    retained_reason: str | None = None


class SessionSummary(_Output):
    """One session this client knows of (SageMaker's ``TrainingSessionSummary``)."""

    session_id: str
    kind: Literal["training", "sampler"]
    status: Literal["Running", "Stopped", "Deleted"]
    base_model: str = ""
    creation_time: float = 0.0
    last_modified_time: float = 0.0
    user_metadata: dict[str, str] = Field(default_factory=dict)

    @property
    def training_session_name(self) -> str:
        return self.session_id

    @property
    def training_session_arn(self) -> str:
        """The session's id (an ARN on sagemaker://)."""
        return self.session_id

    @property
    def training_session_status(self) -> str:
        return self.status


TrainingSessionSummary = SessionSummary


class TrainingRun(_Output):
    """Tinker's ``TrainingRun``: one training session and its checkpoints."""

    training_run_id: str
    base_model: str
    model_owner: str = ""
    last_request_time: float = 0.0
    is_lora: bool = True
    lora_rank: int | None = None
    corrupted: bool = False
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, str] | None = None


class Cursor(_Output):
    """Tinker's page cursor of a listing: the page's ``offset`` and ``limit``, and how many rows there are in all."""

    offset: int
    limit: int
    total_count: int


class CheckpointsListResponse(_Output):
    """Tinker's answer to ``RestClient.list_checkpoints`` / ``list_user_checkpoints``: ``.checkpoints``, newest first."""

    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


class TrainingRunsResponse(_Output):
    """Tinker's answer to ``RestClient.list_training_runs``: ``.training_runs``, newest first."""

    training_runs: list[TrainingRun]
    cursor: Cursor


class SupportedModel(_Output):
    model_name: str
    max_context_length: int
    trainable: bool = True
    sampleable: bool = True
    vocab_size: int | None = None


class ServerCapabilities(_Output):
    supported_models: list[SupportedModel]
    loss_functions: list[str] = Field(default_factory=lambda: list(LOSS_FUNCTIONS))
    max_lora_rank: int = 256
    max_batch_datums: int = 1024
    multi_target_losses: list[str] = Field(default_factory=list)  # losses taking (N, K) target_tokens: K targets per position


class GetInfoResponse(_Output):
    model_id: str
    base_model: str
    lora_rank: int
    lora_alpha: float
    seed: int | None = None
    step: int = 0
    user_metadata: dict[str, str] = Field(default_factory=dict)
    session_options: dict[str, Any] = Field(default_factory=dict)  # SageMaker per-call options, as given

    # Tinker's names for the same facts.
    type: Literal["get_info"] = "get_info"
    is_lora: bool = True

    @property
    def model_name(self) -> str:
        return self.base_model

    @property
    def model_data(self) -> dict[str, Any]:
        return {"base_model": self.base_model, "tokenizer_id": self.base_model}

    @property
    def optimizer_config(self) -> dict[str, Any]:
        return {"type": self.session_options.get("optimizer", "adamw")}


TrainingResult = Union[ForwardBackwardOutput, OptimStepResponse, CheckpointResponse, LoadWeightsResponse]  # noqa: UP007 (3.10 runtime alias)
