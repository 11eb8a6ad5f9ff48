"""Tinker's protobuf wire format <-> asyncsess types, with the schema that ships in the official SDK.

The ``tinker`` package (Apache-2.0) carries ``tinker/proto/tinker_public_pb2``; we import it rather than
keep a copy. Tokens travel as little-endian int32, log-probs as float32, undefined prompt log-probs as
NaN, tensors as raw bytes of float32 / int64. Bodies may be zstd-compressed (``Content-Encoding: zstd``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import InvalidInputError
from ..types import Datum, EncodedTextChunk, ForwardBackwardOutput, ModelInput, SampleResponse, TensorData, TopkLogprobs

__all__ = [
    "ForwardBackwardWire",
    "decode_forward_backward",
    "decompressed_size",
    "encode_forward_backward",
    "encode_forward_backward_output",
    "decode_forward_backward_output",
    "encode_sample_response",
    "decode_sample_response",
    "decompress",
    "compress",
    "BodyTooLarge",
]


def _pb() -> Any:
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as err:  # pragma: no cover - the extra is missing
        raise ImportError("the Tinker wire needs the official SDK's schema: pip install 'asyncsess[tinker]'") from err
    return tinker_public_pb2


_DTYPES: dict[str, tuple[int, Any]] = {"float32": (1, np.float32), "int64": (2, np.int64)}  # DTYPE_FLOAT32, DTYPE_INT64
_NP_OF: dict[int, np.dtype[Any]] = {1: np.dtype("<f4"), 2: np.dtype("<i8"), 3: np.dtype("<i4")}
_NAME_OF = {1: "float32", 2: "int64", 3: "int64"}


MAX_BODY = 1 << 29  # 512 MiB decompressed; the SDK sends <= ~5 MB per chunk
MAX_SPARSE_VALUES = 1 << 24  # cells the sparse (CSR) tensors of one request may expand to (a few bytes of shape asked for terabytes)


class SparseTooLarge(InvalidInputError):
    """The request's sparse tensors expand past the cells the decoder was allowed (see ``decode_forward_backward``)."""


class BodyTooLarge(InvalidInputError):
    """A compressed body that inflates past the size allowed (see ``decompress``)."""


def decompress(body: bytes, max_size: int = MAX_BODY) -> bytes:
    """One zstd frame, inflated to at most ``max_size`` bytes (else :class:`BodyTooLarge`). The frame's declared
    size is never trusted for an allocation: zstandard's one-shot ``decompress`` allocates what the header declares,
    ignoring ``max_output_size`` (17 bytes declaring 1 TB were a MemoryError, 8 GB were allocated)."""
    import zstandard

    declared = decompressed_size(body)
    if declared is not None and declared > max_size:
        raise _too_large(max_size, f"declares {declared} bytes")
    inflate, out, total = zstandard.ZstdDecompressor().decompressobj(), [], 0
    try:
        for i in range(0, len(body), _PIECE):  # a piece inflates to at most ~32 MiB (RLE blocks: 4 bytes -> 128 KiB)
            out.append(inflate.decompress(body[i : i + _PIECE]))
            total += len(out[-1])
            if total > max_size:
                raise _too_large(max_size, f"inflates past {max_size} bytes")
            if inflate.eof:
                break
    except zstandard.ZstdError as err:
        raise InvalidInputError(f"not a zstd frame ({err})", field="body", fix="send Content-Encoding: zstd only with zstd data") from None
    if not inflate.eof:
        raise InvalidInputError("the zstd frame is cut short", field="body", fix="send the whole frame")
    return b"".join(out)


_PIECE = 1024


def _too_large(max_size: int, what: str) -> BodyTooLarge:
    return BodyTooLarge(f"the zstd body {what}", field="body", fix=f"send at most {max_size} bytes decompressed, or split the batch")


def decompressed_size(body: bytes) -> int | None:
    """The content size a zstd frame declares (the SDK's frames do), or None when it declares none or is not zstd."""
    import zstandard

    try:
        size = zstandard.frame_content_size(body)
    except zstandard.ZstdError:
        return None
    return size if size >= 0 else None


def compress(body: bytes, level: int = 3) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=level).compress(body)


class ForwardBackwardWire:
    """A decoded ``ForwardBackwardRequest``. ``error``: why its loss config or data were refused (the model and
    ``seq_id`` are still known, so the server can use up that turn)."""

    __slots__ = ("model_id", "seq_id", "loss_fn", "loss_fn_config", "forward_only", "data", "error")

    def __init__(
        self,
        model_id: str,
        seq_id: int,
        loss_fn: str,
        loss_fn_config: dict[str, float] | None,
        forward_only: bool,
        data: list[Datum],
        error: InvalidInputError | None = None,
    ) -> None:
        self.model_id = model_id
        self.seq_id = seq_id
        self.loss_fn = loss_fn
        self.loss_fn_config = loss_fn_config
        self.forward_only = forward_only
        self.data = data
        self.error = error


def _buffer(raw: bytes, np_dtype: Any, where: str) -> np.ndarray[Any, Any]:
    if len(raw) % np.dtype(np_dtype).itemsize:
        raise InvalidInputError(f"{len(raw)} bytes is not a whole number of {np.dtype(np_dtype).name} values", field=where)
    return np.frombuffer(raw, dtype=np_dtype)


def _tensor_from_pb(msg: Any, where: str, sparse_left: list[int]) -> TensorData:
    """One tensor; ``sparse_left[0]``: the cells the request's sparse tensors may still expand to (taken here)."""
    if msg.dtype not in _NP_OF:
        raise InvalidInputError(f"dtype enum {msg.dtype} is not on the public wire", field=where, fix="send float32 or int64")
    np_dtype = _NP_OF[msg.dtype]
    shape = list(msg.shape)
    if any(d < 0 for d in shape):
        raise InvalidInputError(f"shape {shape} has a negative size", field=where)
    if msg.WhichOneof("encoding") == "sparse_csr":
        if len(shape) != 2:
            raise InvalidInputError("a sparse CSR tensor needs a 2-D shape", field=where)
        if math.prod(shape) > sparse_left[0]:
            raise SparseTooLarge(
                f"sparse shape {shape} expands past the {MAX_SPARSE_VALUES} cells a request's sparse tensors may fill",
                field=where,
                fix="send a smaller tensor, or split the batch",
            )
        sparse_left[0] -= math.prod(shape)
        values = _buffer(msg.sparse_csr.values, np_dtype, where)
        crow = _buffer(msg.sparse_csr.crow_indices, "<i8", where)
        col = _buffer(msg.sparse_csr.col_indices, "<i8", where)
        if len(crow) != shape[0] + 1 or len(col) != len(values) or crow[0] != 0 or crow[-1] != len(values) or np.any(np.diff(crow) < 0):
            raise InvalidInputError("inconsistent CSR indices", field=where)
        if np.any(col >= shape[1]) or np.any(col < 0):
            raise InvalidInputError("CSR column index out of range", field=where)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        if len(np.unique(rows * shape[1] + col)) != len(col):
            raise InvalidInputError("a CSR cell is listed twice", field=where, fix="list each (row, column) once")
        dense = np.zeros(shape, dtype=np_dtype)
        dense[rows, col] = values
        arr = dense
    else:
        arr = _buffer(msg.dense, np_dtype, where)
        shape = shape or [arr.size]
        if math.prod(shape) != arr.size:
            raise InvalidInputError(f"shape {shape} does not hold {arr.size} values", field=where)
        arr = arr.reshape(shape)
    dtype = _NAME_OF[msg.dtype]
    if dtype == "float32" and not np.isfinite(arr).all():
        raise InvalidInputError("holds NaN or infinity", field=where, fix="send finite values (mask with weights = 0 instead)")
    return TensorData.model_construct(data=arr.ravel().tolist(), dtype=dtype, shape=list(arr.shape))


def decode_forward_backward(body: bytes, max_sparse_values: int = MAX_SPARSE_VALUES) -> ForwardBackwardWire:
    """Parse a (decompressed) ``ForwardBackwardRequest``. A body that is not one raises ``InvalidInputError``; bad
    config or data come back as the wire's ``error``, naming the field. Sparse tensors that would expand past
    ``max_sparse_values`` cells raise :class:`SparseTooLarge` (a caller decoding on its event loop passes a small
    budget and decodes again in a thread when it is exceeded)."""
    pb = _pb()
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as err:  # protobuf's DecodeError
        raise InvalidInputError(f"not a ForwardBackwardRequest protobuf ({err})", field="body") from None
    wire = ForwardBackwardWire(msg.model_id, msg.seq_id, msg.loss_fn, None, msg.forward_only, [])
    try:
        wire.loss_fn_config = _config_from_pb(msg)
        sparse_left = [min(max_sparse_values, MAX_SPARSE_VALUES)]
        wire.data = [_datum_from_pb(d, i, sparse_left) for i, d in enumerate(msg.data)]
    except InvalidInputError as err:
        if isinstance(err, SparseTooLarge) and max_sparse_values < MAX_SPARSE_VALUES:
            raise
        wire.error = err
    return wire


def _config_from_pb(msg: Any) -> dict[str, float] | None:
    config: dict[str, float] = {}
    for k, v in msg.loss_fn_config_v2.items():
        if v.WhichOneof("value") == "text":
            raise InvalidInputError("string values are not supported", field=f"loss_fn_config[{k!r}]", fix="give a number")
        config[k] = v.number
    for k, num in msg.loss_fn_config.items():
        config.setdefault(k, num)
    return config or None


def _datum_from_pb(d: Any, i: int, sparse_left: list[int]) -> Datum:
    chunks = []
    for j, c in enumerate(d.model_input):
        kind = c.WhichOneof("chunk")
        if kind != "encoded_text":
            raise InvalidInputError(f"{kind} chunks are not supported", field=f"data[{i}].model_input[{j}]", fix="send token ids")
        raw = c.encoded_text.tokens
        if len(raw) % 4:
            raise InvalidInputError("token bytes are not int32", field=f"data[{i}].model_input[{j}]")
        chunks.append(EncodedTextChunk.model_construct(tokens=np.frombuffer(raw, dtype="<i4").tolist(), type="encoded_text"))
    inputs = {k: _tensor_from_pb(t, f"data[{i}].loss_fn_inputs[{k!r:.60}]", sparse_left) for k, t in d.loss_fn_inputs.items()}
    return Datum.model_construct(model_input=ModelInput.model_construct(chunks=chunks), loss_fn_inputs=inputs)


def _tensor_to_pb(msg: Any, td: TensorData) -> None:
    code, np_dtype = _DTYPES[td.dtype]
    msg.dtype = code
    msg.shape.extend(td.shape or [len(td.data)])
    msg.dense = np.asarray(td.data, dtype=np_dtype).tobytes()


def encode_forward_backward(
    model_id: str, seq_id: int, data: list[Datum], loss_fn: str, loss_fn_config: dict[str, float] | None = None, forward_only: bool = False
) -> bytes:
    """Serialize a ``ForwardBackwardRequest`` as the SDK does (the client side of the wire)."""
    pb = _pb()
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn=loss_fn, forward_only=forward_only)
    for k, v in (loss_fn_config or {}).items():
        msg.loss_fn_config[k] = float(v)
        msg.loss_fn_config_v2[k].number = float(v)
    for datum in data:
        dm = msg.data.add()
        for chunk in datum.model_input.chunks:
            dm.model_input.add().encoded_text.tokens = np.asarray(chunk.tokens, dtype="<i4").tobytes()
        for name, td in datum.loss_fn_inputs.items():
            _tensor_to_pb(dm.loss_fn_inputs[name], td)
    return msg.SerializeToString()


def encode_forward_backward_output(out: ForwardBackwardOutput) -> bytes:
    """``ArrayRecord``s: per field, the datums' values concatenated with int64 byte offsets. Each record holds a run
    of datums whose fields have the same trailing shape (the ``K`` of an ``(N, K)`` output), which it carries."""
    pb = _pb()
    msg = pb.ForwardBackwardOutput(loss_fn_output_type=out.loss_fn_output_type or "ArrayRecord")
    for k, v in out.metrics.items():
        msg.metrics[k] = float(v)
    for run in _runs_of_trailing_shape(out.loss_fn_outputs):
        rec = msg.loss_fn_outputs.add(num_datums=len(run))
        for name in run[0]:
            tds = [d[name] for d in run]
            code, np_dtype = _DTYPES[tds[0].dtype]
            arrays = [np.asarray(t.data, dtype=np_dtype) for t in tds]
            offsets = np.zeros(len(arrays) + 1, dtype="<i8")
            np.cumsum([a.nbytes for a in arrays], out=offsets[1:])
            bt = rec.fields[name]
            bt.dtype = code
            bt.data = np.concatenate(arrays).tobytes() if arrays else b""
            bt.offsets = offsets.tobytes()
            bt.trailing_shape.extend(_trailing(tds[0]))
    return msg.SerializeToString()


def _trailing(td: TensorData) -> list[int]:
    return list(td.shape[1:]) if td.shape else []


def _runs_of_trailing_shape(outputs: list[dict[str, TensorData]]) -> list[list[dict[str, TensorData]]]:
    """Consecutive datums grouped while every field keeps its trailing shape."""
    runs: list[list[dict[str, TensorData]]] = []
    key = None
    for d in outputs:
        k = [(name, _trailing(td)) for name, td in d.items()]
        if not runs or k != key:
            runs.append([])
            key = k
        runs[-1].append(d)
    return runs


def decode_forward_backward_output(body: bytes) -> ForwardBackwardOutput:
    pb = _pb()
    msg = pb.ForwardBackwardOutput()
    msg.ParseFromString(body)
    outputs: list[dict[str, TensorData]] = []
    for rec in msg.loss_fn_outputs:
        per: list[dict[str, TensorData]] = [{} for _ in range(rec.num_datums)]
        for name, bt in rec.fields.items():
            np_dtype = _NP_OF[bt.dtype]
            offsets = np.frombuffer(bt.offsets, dtype="<i8")
            buf = np.frombuffer(bt.data, dtype=np_dtype)
            trailing = list(bt.trailing_shape)
            width = math.prod(trailing)
            for i in range(len(offsets) - 1):
                part = buf[int(offsets[i]) // np_dtype.itemsize : int(offsets[i + 1]) // np_dtype.itemsize]
                shape = [part.size // width if width else 0, *trailing]
                per[i][name] = TensorData.model_construct(data=part.tolist(), dtype=_NAME_OF[bt.dtype], shape=shape)
        outputs.extend(per)
    return ForwardBackwardOutput.model_construct(
        loss_fn_output_type=msg.loss_fn_output_type, loss_fn_outputs=outputs, metrics=dict(msg.metrics)
    )


MASK_LOGPROB = -99999.0  # Tinker's TopkLogprobs sentinel (with token id 0) for an unscored position or cell


def encode_sample_response(resp: SampleResponse) -> bytes:
    pb = _pb()
    msg = pb.SampleResponse()
    for s in resp.sequences:
        sm = msg.sequences.add(stop_reason=pb.STOP_REASON_STOP if s.stop_reason == "stop" else pb.STOP_REASON_LENGTH)
        sm.tokens = np.asarray(s.tokens, dtype="<i4").tobytes()
        if s.logprobs is not None:
            sm.logprobs = np.asarray(s.logprobs, dtype="<f4").tobytes()
        if s.topk_logprobs is not None:
            _topk_to_pb(sm.topk_sampled_logprobs, s.topk_logprobs)
    if resp.prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray([math.nan if v is None else v for v in resp.prompt_logprobs], dtype="<f4").tobytes()
    if resp.topk_prompt_logprobs is not None:
        _topk_to_pb(msg.topk_prompt_logprobs, resp.topk_prompt_logprobs)
    if resp.target_prompt_logprobs is not None:
        td = resp.target_prompt_logprobs
        msg.target_prompt_logprobs.dense = np.asarray(td.data, dtype="<f4").tobytes()
        msg.target_prompt_logprobs.dtype = _DTYPES["float32"][0]
        msg.target_prompt_logprobs.shape.extend(td.shape or [len(td.data)])
    return msg.SerializeToString()


def _topk_to_pb(msg: Any, rows: TopkLogprobs) -> None:
    """Tinker's ``TopkLogprobs``: ``(len(rows), k)`` int32 ids and float32 log-probs, an unscored row (``None``) or
    a short one padded with ``(0, MASK_LOGPROB)``. Rows none of which is scored (a 1-token prompt's) are one masked
    column wide: at ``k == 0`` the SDK reads the whole field as absent (``None``, not ``[None]``)."""
    k = max((len(r) for r in rows if r), default=1)
    ids = np.zeros((len(rows), k), dtype="<i4")
    lps = np.full((len(rows), k), MASK_LOGPROB, dtype="<f4")
    for i, row in enumerate(rows):
        for j, (token, lp) in enumerate(row or ()):
            ids[i, j], lps[i, j] = token, lp
    msg.token_ids, msg.logprobs, msg.k, msg.length = ids.tobytes(), lps.tobytes(), k, len(rows)


def _topk_from_pb(msg: Any) -> TopkLogprobs:
    ids = np.frombuffer(msg.token_ids, dtype="<i4").reshape(msg.length, msg.k).tolist()
    lps = np.frombuffer(msg.logprobs, dtype="<f4").reshape(msg.length, msg.k).tolist()
    rows: TopkLogprobs = []
    for row_ids, row_lps in zip(ids, lps):
        pairs = [(t, lp) for t, lp in zip(row_ids, row_lps) if not (t == 0 and lp == MASK_LOGPROB)]
        rows.append(pairs or None)
    return rows if msg.k else [None] * msg.length


def decode_sample_response(body: bytes) -> SampleResponse:
    from ..types import SampledSequence

    pb = _pb()
    msg = pb.SampleResponse()
    msg.ParseFromString(body)
    seqs = [
        SampledSequence.model_construct(
            stop_reason="stop" if s.stop_reason == pb.STOP_REASON_STOP else "length",
            tokens=np.frombuffer(s.tokens, dtype="<i4").tolist(),
            logprobs=np.frombuffer(s.logprobs, dtype="<f4").tolist() if s.HasField("logprobs") else None,
            sequence_id=None,
            topk_logprobs=_topk_from_pb(s.topk_sampled_logprobs) if s.HasField("topk_sampled_logprobs") else None,
        )
        for s in msg.sequences
    ]
    plp = None
    if msg.HasField("prompt_logprobs"):
        plp = [None if math.isnan(v) else float(v) for v in np.frombuffer(msg.prompt_logprobs, dtype="<f4").tolist()]
    target = None
    if msg.HasField("target_prompt_logprobs"):
        t = msg.target_prompt_logprobs
        target = TensorData.model_construct(data=np.frombuffer(t.dense, dtype="<f4").tolist(), dtype="float32", shape=list(t.shape))
    return SampleResponse.model_construct(
        sequences=seqs,
        prompt_logprobs=plp,
        topk_prompt_logprobs=_topk_from_pb(msg.topk_prompt_logprobs) if msg.HasField("topk_prompt_logprobs") else None,
        target_prompt_logprobs=target,
    )
