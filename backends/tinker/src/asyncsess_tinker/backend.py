"""The ``tinker://`` driver: asyncsess's Backend seam over Tinker's HTTP API (httpx, protobuf, long-poll).

``tinker://host:port`` talks plain HTTP, ``tinkers://host[:port]`` HTTPS; a URL path is kept as the base
path. The API key comes from ``?api_key=``, the ``api_key`` option or ``$TINKER_API_KEY``. One Tinker
session per backend; asyncsess's sequence numbers are Tinker's per-model ``seq_id`` (both start at 1),
so a retried op reaches the server under the same ``(model_id, seq_id)`` and is applied once.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, ClassVar

import anyio
import httpx

from asyncsess.backends import (
    Backend,
    ForwardBackwardOp,
    ForwardOp,
    LoadStateOp,
    OptimStepOp,
    ParsedURL,
    SampleRequest,
    SamplerSpec,
    SaveStateOp,
    SaveWeightsOp,
    Tokenizer,
    TrainingOp,
    TrainingSessionSpec,
    require_op,
    unknown_op,
)
from asyncsess.backends.http import MAX_RESPONSE_BYTES, read_capped, response_limit
from asyncsess.errors import (
    APIResponseValidationError,
    AsyncSessError,
    ConflictError,
    InvalidInputError,
    ServerError,
    SessionGoneError,
    TransientError,
    UnsupportedError,
)
from asyncsess.retry import retry_after_seconds
from asyncsess.serve import tinker_proto
from asyncsess.types import (
    Checkpoint,
    CheckpointResponse,
    GetInfoResponse,
    LoadWeightsResponse,
    OptimStepResponse,
    SampleResponse,
    ServerCapabilities,
    SupportedModel,
    TrainingResult,
    Usage,
)

__all__ = ["TinkerBackend"]

PROTO = "application/x-protobuf"
KEEP_SAMPLE_IDS = 1024  # per sampler: request_ids whose seq_id a retry reuses (Tinker-wire servers keep ~1024 seq_ids)
_FOLDER_KIND = {"weights": "training", "sampler_weights": "sampler"}


class TinkerBackend(Backend):
    """A client of Tinker's wire: the hosted service, ``asyncsess serve``, or another compatible server."""

    scheme: ClassVar[str] = "tinker"

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        *,
        timeout: float = 60.0,
        poll_timeout: float = 45.0,
        tokenizer: Tokenizer | str | None = None,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_response_bytes = response_limit(max_response_bytes)
        self.api_key = api_key
        self.timeout = timeout
        self.poll_timeout = poll_timeout
        self.session_id: str | None = None
        self._http: httpx.AsyncClient | None = None
        self._compress = False
        self._model_seq = 0
        self._sampler_seq = 0
        self._sample_seq: dict[str, int] = {}
        self._sample_ids: dict[str, OrderedDict[str, int]] = {}  # sampler -> request_id -> its seq_id, the newest last
        self._models: dict[str, GetInfoResponse] = {}
        self._tokenizers: dict[str, Any] = {}  # Hugging Face tokenizers (a Tokenizer)
        self._tokenizer = tokenizer
        self._tokenizer_ids: dict[str, str] = {}

    @classmethod
    def from_url(cls, url: ParsedURL, **options: Any) -> TinkerBackend:
        if not url.host:
            raise InvalidInputError(f"{url.raw!r} names no host", field="url", fix="e.g. tinker://127.0.0.1:8000")
        http = "https" if url.scheme == "tinkers" else "http"
        port = f":{url.port}" if url.port else ""
        key = url.query.get("api_key") or options.get("api_key") or os.environ.get("TINKER_API_KEY")
        tokenizer = options.get("tokenizer") or url.query.get("tokenizer")
        limit = options.get("max_response_bytes", MAX_RESPONSE_BYTES)
        return cls(
            f"{http}://{url.host}{port}{url.path}",
            key,
            timeout=url.get_float("timeout", 60.0),
            tokenizer=tokenizer,
            max_response_bytes=limit,
        )

    # ------------------------------------------------------------------------------- transport

    async def open(self) -> None:
        headers = {"X-API-Key": self.api_key} if self.api_key else {}
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=self.timeout)
        config = await self._post("/api/v1/client/config", {"sdk_version": "asyncsess"})
        self._compress = config.get("proto_compress_fwdbwd") is True
        created = await self._post("/api/v1/create_session", {"tags": ["asyncsess"], "user_metadata": {}, "sdk_version": "asyncsess"})
        self.session_id = _text(created, "session_id")

    async def aclose(self) -> None:
        if self._http is None:
            return
        try:
            if self.session_id is not None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    await self._post(f"/api/v1/sessions/{self.session_id}/finish", {"reason": {"type": "success"}})
        except Exception:  # the server may already be gone; nothing left to release there
            pass
        finally:
            await self._http.aclose()
            self._http = None

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            raise SessionGoneError("the tinker:// backend is not open (use ServiceClient as an async context manager)")
        return self._http

    async def _send(self, method: str, path: str, **kw: Any) -> tuple[httpx.Response, bytes]:
        """The answer and its body (at most ``max_response_bytes`` decoded); a refusal raised typed. Redirects are
        not followed: the API key goes to ``base_url`` only."""
        client = self._client()
        try:
            resp = await client.send(client.build_request(method, path, **kw), stream=True)
            try:
                content = await read_capped(resp, self.max_response_bytes, path)
            finally:
                await resp.aclose()
        except httpx.TimeoutException as err:
            raise TransientError(f"{path}: timed out ({err!r})") from err
        except httpx.TransportError as err:
            lost = isinstance(err, (httpx.ReadError, httpx.RemoteProtocolError))
            raise TransientError(f"{path}: connection failed ({err!r})", lost_response=lost) from err
        except httpx.DecodingError as err:
            raise APIResponseValidationError(f"{path}: the answer's Content-Encoding does not decode: {err}") from None
        if 300 <= resp.status_code < 400:
            where = resp.headers.get("location", "")[:200]
            raise APIResponseValidationError(f"{path}: the server answered {resp.status_code}, a redirect to {where!r}: not followed")
        if resp.status_code >= 400 and resp.status_code != 408:
            _raise_for(resp, content, path)
        return resp, content

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return _object(path, (await self._send("POST", path, json=body))[1])

    async def _get(self, path: str, **params: Any) -> dict[str, Any]:
        return _object(path, (await self._send("GET", path, params=params))[1])

    async def _result(self, future: dict[str, Any], *, proto: bool = False) -> Any:
        """Long-poll ``retrieve_future`` until the promise is done; raise its failure as a typed error. The answer
        is a JSON object, or (``proto``) protobuf bytes; anything else is an APIResponseValidationError."""
        headers = {"Accept": PROTO} if proto else {}
        rid = _text(future, "request_id")
        while True:
            resp, content = await self._send(
                "POST", "/api/v1/retrieve_future", json={"request_id": rid}, headers=headers, timeout=self.poll_timeout + 15
            )
            if resp.status_code == 408:
                continue
            if PROTO in resp.headers.get("content-type", ""):
                if not proto:
                    raise APIResponseValidationError(f"retrieve_future: a protobuf answer to a JSON request ({rid})", request_id=rid)
                return content
            body = _object("retrieve_future", content)
            if body.get("type") == "try_again":
                continue
            if "error" in body and "category" in body:
                msg = str(body["error"])[:2000]
                if body["category"] == "user":
                    raise InvalidInputError(msg, request_id=rid)
                raise ServerError(msg, request_id=rid)
            if proto:
                raise APIResponseValidationError(
                    f"retrieve_future: a JSON answer where protobuf was asked: {str(body)[:200]!r}", request_id=rid
                )
            return body

    # ---------------------------------------------------------------------------------- seam

    async def capabilities(self) -> ServerCapabilities:
        body = await self._get("/api/v1/get_server_capabilities")
        with _reading("get_server_capabilities"):
            return self._capabilities(body)

    @staticmethod
    def _capabilities(body: dict[str, Any]) -> ServerCapabilities:
        return ServerCapabilities(
            supported_models=[
                SupportedModel(
                    model_name=m.get("model_name") or "",
                    max_context_length=m.get("max_context_length") or 0,
                    trainable=m.get("trainable", True) is not False,
                    sampleable=m.get("sampleable", True) is not False,
                    vocab_size=m.get("vocab_size"),
                )
                for m in body.get("supported_models", [])
            ],
            multi_target_losses=_multi_target_losses(body),
        )

    async def create_training_session(self, spec: TrainingSessionSpec) -> GetInfoResponse:
        seq = self._model_seq
        self._model_seq += 1
        if spec.from_path is not None:
            body: dict[str, Any] = {
                "session_id": self.session_id,
                "model_seq_id": seq,
                "path": spec.from_path,
                "optimizer": spec.with_optimizer,
                "base_model": spec.base_model or None,
                "type": "load_weights",
            }
            fut = await self._post("/api/v1/load_weights", {k: v for k, v in body.items() if v is not None})
            loaded = await self._result(fut)
            model_id = _text(loaded, "model_id") if "model_id" in loaded else f"{self.session_id}:train:{seq}"
        else:
            lora = {"rank": spec.rank, "seed": spec.seed, "train_mlp": spec.train_mlp, "train_attn": spec.train_attn}
            lora["train_unembed"] = spec.train_unembed
            body = {
                "session_id": self.session_id,
                "model_seq_id": seq,
                "base_model": spec.base_model,
                "lora_config": {k: v for k, v in lora.items() if v is not None},
                "user_metadata": dict(spec.user_metadata) or None,
                "type": "create_model",
            }
            fut = await self._post("/api/v1/create_model", body)
            model_id = _text(await self._result(fut), "model_id")
        info = await self._post("/api/v1/get_info", {"model_id": model_id, "type": "get_info"})
        with _reading("get_info"):
            data = info.get("model_data") or {}
            out = GetInfoResponse(
                model_id=model_id,
                base_model=info.get("model_name") or data.get("model_name") or spec.base_model,
                lora_rank=info.get("lora_rank") or spec.rank,
                lora_alpha=spec.alpha if spec.alpha is not None else 32.0,
                seed=spec.seed,
            )
            tokenizer_id = data.get("tokenizer_id")
            if tokenizer_id is not None and not isinstance(tokenizer_id, str):
                raise TypeError(f"tokenizer_id {tokenizer_id!r:.60} is not text")
        self._models[model_id] = out
        if tokenizer_id:
            self._tokenizer_ids[out.base_model] = tokenizer_id
        return out

    async def stop_session(self, session_id: str) -> None:
        if session_id in self._models:
            del self._models[session_id]
            try:
                await self._post("/api/v1/unload_model", {"model_id": session_id, "type": "unload_model"})
            except (InvalidInputError, SessionGoneError):
                pass  # already gone
        else:
            self._sample_seq.pop(session_id, None)
            self._sample_ids.pop(session_id, None)

    async def heartbeat(self, session_id: str) -> None:
        await self._post("/api/v1/session_heartbeat", {"session_id": self.session_id, "type": "session_heartbeat"})

    def precheck(self, session_id: str, op: TrainingOp) -> None:
        """Refuse, before the op takes its number, what Tinker's wire cannot carry: a LoRA+ ratio, merged weights, a
        token id past int32 (the wire's token type). Refused once numbered, the op was never sent: it poisoned the
        training client, and the server waited for its ``seq_id``."""
        match op:
            case OptimStepOp(adam_params=adam) if adam.lora_plus_lr_ratio is not None:
                raise UnsupportedError("Tinker's wire has no LoRA+ ratio", field="adam_params.lora_plus_lr_ratio", fix="leave it None")
            case SaveWeightsOp(merge_weights=True):
                raise UnsupportedError(
                    "Tinker's wire saves LoRA sampler weights only", field="merge_weights", fix="use merge_weights=False"
                )
            case ForwardOp(data=data) | ForwardBackwardOp(data=data):
                for d in data:
                    tokens = d.model_input.to_ints()
                    if tokens and not 0 <= min(tokens) <= max(tokens) < 2**31:
                        bad = next(t for t in tokens if not 0 <= t < 2**31)
                        raise InvalidInputError(
                            f"token id {bad} does not fit Tinker's wire (int32)", field="model_input", fix="use the model's token ids"
                        )

    async def execute_training(self, session_id: str, op: TrainingOp) -> TrainingResult:
        op = require_op(op)
        self.precheck(session_id, op)
        base = {"model_id": session_id, "seq_id": op.seq}
        match op:
            case ForwardOp() | ForwardBackwardOp():
                raw = tinker_proto.encode_forward_backward(
                    session_id, op.seq, list(op.data), op.loss_fn, op.loss_fn_config, forward_only=isinstance(op, ForwardOp)
                )
                headers = {"Content-Type": PROTO}
                if self._compress:
                    raw = await anyio.to_thread.run_sync(tinker_proto.compress, raw)
                    headers["Content-Encoding"] = "zstd"
                fut = _object("forward_backward", (await self._send("POST", "/api/v1/forward_backward", content=raw, headers=headers))[1])
                answer = await self._result(fut, proto=True)
                with _reading("forward_backward"):
                    fb = tinker_proto.decode_forward_backward_output(answer)
                    _check_outputs(fb, op.data)
                fb.usage = Usage(training_tokens=sum(d.model_input.length for d in op.data))
                return fb
            case OptimStepOp(adam_params=adam):
                params = adam.model_dump(exclude={"lora_plus_lr_ratio"})
                out = await self._result(await self._post("/api/v1/optim_step", {**base, "adam_params": params, "type": "optim_step"}))
                with _reading("optim_step"):
                    return OptimStepResponse(metrics=out.get("metrics"))
            case SaveStateOp():
                name = op.name or f"{op.seq:06d}"
                body = {**base, **_save_fields(op), "path": name, "type": "save_weights"}
                out = await self._result(await self._post("/api/v1/save_weights", body))
                return CheckpointResponse(path=_text(out, "path"), kind="state")
            case SaveWeightsOp():
                name = op.name or (f"ephemeral-{op.seq:06d}-{uuid.uuid4().hex[:8]}" if op.ephemeral else f"{op.seq:06d}")
                body = {**base, **_save_fields(op), "path": name, "type": "save_weights_for_sampler"}
                out = await self._result(await self._post("/api/v1/save_weights_for_sampler", body))
                return CheckpointResponse(path=_text(out, "path"), kind="sampler")
            case LoadStateOp(path=path, with_optimizer=with_optimizer):
                body = {**base, "path": path, "optimizer": with_optimizer, "type": "load_weights"}
                out = await self._result(await self._post("/api/v1/load_weights", body))
                got = out.get("path")
                return LoadWeightsResponse(path=got if isinstance(got, str) and got else path)
            case _:
                unknown_op(op)

    async def create_sampler(self, spec: SamplerSpec) -> str:
        seq = self._sampler_seq
        self._sampler_seq += 1
        body = {"session_id": self.session_id, "sampling_session_seq_id": seq, "type": "create_sampling_session"}
        if spec.model_path:
            body["model_path"] = spec.model_path
        elif spec.base_model:
            body["base_model"] = spec.base_model
        else:
            raise InvalidInputError("neither model_path nor base_model", field="model_path", fix="pass a saved path or a base model name")
        sid = _text(await self._post("/api/v1/create_sampling_session", body), "sampling_session_id")
        self._sample_seq[sid] = 0
        self._sample_ids[sid] = OrderedDict()
        return sid

    async def _asample(self, sampler_id: str, body: dict[str, Any], request_id: str = "") -> SampleResponse:
        """Submit and wait. A retry of one request (same ``request_id``) is sent under the same ``seq_id``, as
        Tinker's SDK does, so the server hands back the future it already has instead of sampling again."""
        if sampler_id not in self._sample_seq:
            raise InvalidInputError(f"no sampler {sampler_id!r} on this client", field="sampler_id", fix="use an id from create_sampler")
        ids = self._sample_ids[sampler_id]
        seq = ids.get(request_id) if request_id else None
        if seq is None:
            seq = self._sample_seq[sampler_id]
            self._sample_seq[sampler_id] = seq + 1
            if request_id:
                ids[request_id] = seq
                if len(ids) > KEEP_SAMPLE_IDS:
                    ids.popitem(last=False)
        body = {**body, "sampling_session_id": sampler_id, "seq_id": seq, "type": "sample"}
        fut = _object(
            "asample", (await self._send("POST", "/api/v1/asample", json=body, headers={"X-Tinker-Sampling-Backpressure": "1"}))[1]
        )
        answer = await self._result(fut, proto=True)
        with _reading("asample"):
            resp = tinker_proto.decode_sample_response(answer)
            _check_sample(resp, body)
        names = fut.get("sample_sequence_ids")  # the server names each sequence when it takes the request (as the SDK reads them)
        if isinstance(names, list) and len(names) == len(resp.sequences):
            for sequence, name in zip(resp.sequences, names):
                sequence.sequence_id = str(name)
        return resp

    async def sample(self, sampler_id: str, request: SampleRequest) -> SampleResponse:
        params = request.sampling_params.model_dump(exclude_none=True)
        body = {
            "num_samples": request.num_samples,
            "prompt": {"chunks": [{"tokens": list(request.prompt), "type": "encoded_text"}]},
            "sampling_params": params,
            "prompt_logprobs": request.include_prompt_logprobs or None,
            "topk_prompt_logprobs": request.topk_prompt_logprobs or None,
            "topk_sample_logprobs": request.topk_sample_logprobs or None,
            "target_prompt_logprobs": _target_json(request.target_prompt_logprobs),
        }
        return await self._asample(sampler_id, {k: v for k, v in body.items() if v is not None}, request.request_id)

    async def compute_logprobs(self, sampler_id: str, tokens: list[int]) -> list[float | None]:
        body = {
            "num_samples": 1,
            "prompt": {"chunks": [{"tokens": list(tokens), "type": "encoded_text"}]},
            "sampling_params": {"max_tokens": 1},
            "prompt_logprobs": True,
        }
        resp = await self._asample(sampler_id, body)
        return list(resp.prompt_logprobs or [])

    def get_tokenizer(self, base_model: str) -> Tokenizer:
        """The ``tokenizer`` option (an object, or a name / local path), else the ``tokenizer_id`` the server
        named in ``get_info`` (else the base model), loaded with transformers."""
        if self._tokenizer is not None and not isinstance(self._tokenizer, str):
            return self._tokenizer
        if base_model not in self._tokenizers:
            name = self._tokenizer or self._tokenizer_ids.get(base_model) or base_model
            try:
                from transformers import AutoTokenizer
            except ImportError as err:
                raise UnsupportedError(
                    "tinker:// loads tokenizers with transformers", field="tokenizer", fix="pip install 'asyncsess-tinker[tokenizer]'"
                ) from err
            try:
                self._tokenizers[base_model] = AutoTokenizer.from_pretrained(name)
            except Exception as err:
                raise UnsupportedError(
                    f"cannot load the tokenizer {name!r}: {err}",
                    field="tokenizer",
                    fix="pass tokenizer=<a tokenizer, a local path or a hub id>",
                ) from err
        return self._tokenizers[base_model]

    async def list_checkpoints(self, session_id: str | None = None) -> list[Checkpoint]:
        if session_id:
            rows = (await self._get(f"/api/v1/training_runs/{session_id}/checkpoints")).get("checkpoints", [])
        else:
            rows = await self._user_checkpoints()
        with _reading("checkpoints"):
            return [_checkpoint(c) for c in rows]

    async def _user_checkpoints(self, page: int = 100) -> list[dict[str, Any]]:
        """Every page of ``list_user_checkpoints`` (the server pages them, newest first)."""
        rows: list[dict[str, Any]] = []
        while True:
            body = await self._get("/api/v1/checkpoints", limit=page, offset=len(rows))
            with _reading("checkpoints"):
                batch = body.get("checkpoints", [])
                if not isinstance(batch, list):
                    raise TypeError("checkpoints is not a list")
                rows += batch
                total = (body.get("cursor") or {}).get("total_count", 0)
                if not batch or isinstance(total, bool) or not isinstance(total, int) or len(rows) >= total:
                    return rows

    async def delete_checkpoint(self, path: str) -> None:
        """Tinker's REST delete of a ``tinker://<run>/<folder>/<name>`` path."""
        run, _, checkpoint_id = path.removeprefix("tinker://").partition("/")
        if not path.startswith("tinker://") or not run or "/" not in checkpoint_id:
            raise InvalidInputError(f"{path!r:.80} is not a Tinker checkpoint path", field="path", fix="tinker://<run>/weights/<name>")
        await self._send("DELETE", f"/api/v1/training_runs/{run}/checkpoints/{checkpoint_id}")


def _checkpoint(c: dict[str, Any]) -> Checkpoint:
    """A checkpoint row of Tinker's REST listings."""
    folder = str(c.get("checkpoint_id", "")).split("/", 1)[0]
    return Checkpoint(
        checkpoint_id=c["checkpoint_id"],
        checkpoint_type=_FOLDER_KIND.get(folder, "training"),  # type: ignore[arg-type]
        path=c.get("tinker_path", ""),
        time=_epoch(c.get("time")),
        size_bytes=c.get("size_bytes"),
        user_metadata=c.get("user_metadata"),
        expires_at=_epoch(c["expires_at"]) if c.get("expires_at") else None,
        public=bool(c.get("public")),
    )


def _epoch(value: Any) -> float:
    import datetime

    if isinstance(value, (int, float)):
        return float(value)
    try:
        return datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _object(path: str, content: bytes) -> dict[str, Any]:
    """A JSON object answer, or an APIResponseValidationError (not JSON, not an object)."""
    try:
        body = json.loads(content)
    except ValueError:
        raise APIResponseValidationError(f"{path}: the answer is not JSON: {content[:200]!r}") from None
    if not isinstance(body, dict):
        raise APIResponseValidationError(f"{path}: the answer is not a JSON object: {str(body)[:200]!r}")
    return body


def _text(body: dict[str, Any], key: str) -> str:
    """``body[key]``, a non-empty string, or an APIResponseValidationError."""
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise APIResponseValidationError(f"the server's answer has no {key} (text): {str(body)[:200]!r}")
    return value


@contextlib.contextmanager
def _reading(what: str) -> Iterator[None]:
    """Decoding a server's answer: any failure but our typed errors is an APIResponseValidationError naming ``what``."""
    try:
        yield
    except AsyncSessError:
        raise
    except Exception as err:  # KeyError, TypeError, pydantic's ValidationError, protobuf's DecodeError, numpy's ValueError
        raise APIResponseValidationError(f"{what}: the server's answer does not decode: {type(err).__name__}: {str(err)[:300]}") from err


def _check_outputs(fb: Any, data: Any) -> None:
    """One output per datum, each tensor one value per token: a server's short or long answer is not accepted."""
    if len(fb.loss_fn_outputs) != len(data):
        raise APIResponseValidationError(f"forward_backward: {len(fb.loss_fn_outputs)} outputs for {len(data)} datums")
    for i, (out, datum) in enumerate(zip(fb.loss_fn_outputs, data)):
        for name, td in out.items():
            if td.shape and td.shape[0] != datum.model_input.length:
                raise APIResponseValidationError(
                    f"forward_backward: output {name!r} of datum {i} has {td.shape[0]} rows for {datum.model_input.length} tokens"
                )


def _check_sample(resp: SampleResponse, body: dict[str, Any]) -> None:
    """As many sequences as asked, one log-prob per token, no negative token id."""
    if len(resp.sequences) != body["num_samples"]:
        raise APIResponseValidationError(f"asample: {len(resp.sequences)} sequences for num_samples={body['num_samples']}")
    for s in resp.sequences:
        if s.logprobs is not None and len(s.logprobs) != len(s.tokens):
            raise APIResponseValidationError(f"asample: {len(s.logprobs)} log-probs for {len(s.tokens)} sampled tokens")
        if any(t < 0 for t in s.tokens):
            raise APIResponseValidationError("asample: a sampled token id is negative")


def _raise_for(resp: httpx.Response, content: bytes, path: str) -> None:
    try:
        body = json.loads(content)
    except ValueError:
        body = {"error": content[:500].decode("utf-8", "replace")}
    if not isinstance(body, dict):
        body = {"error": str(body)[:500]}
    message = str(body.get("error") or body.get("detail") or resp.reason_phrase)[:2000]
    status = resp.status_code
    # the field and fix a server names (asyncsess serve's {"error", "field", "fix"}) stay on the typed error
    field = body["field"][:200] if isinstance(body.get("field"), str) else None
    fix = body["fix"][:2000] if isinstance(body.get("fix"), str) else None
    if status == 409:
        raise ConflictError(message, field=field, fix=fix)
    if status == 410:
        raise SessionGoneError(f"{path}: {message}")
    if status == 429 or status >= 500:
        hint = retry_after_seconds(resp.headers.get("retry-after"))
        raise TransientError(f"{path}: HTTP {status}: {message}", retry_after=hint)
    if status in (401, 403):
        raise InvalidInputError(message, field="api_key", fix="pass ?api_key=, api_key=... or set TINKER_API_KEY")
    raise InvalidInputError(message, field=field, fix=fix)


def _save_fields(op: SaveStateOp | SaveWeightsOp) -> dict[str, Any]:
    """What Tinker's save requests carry besides the name, the ones set only (``overwrite`` is save_state's field;
    asyncsess serve also takes it on a sampler save, sent only when true)."""
    fields = {"ttl_seconds": op.ttl_seconds, "user_metadata": dict(op.user_metadata) if op.user_metadata else None}
    if op.overwrite or isinstance(op, SaveStateOp):
        fields["overwrite"] = op.overwrite
    return {k: v for k, v in fields.items() if v is not None}


def _target_json(rows: tuple[tuple[int, ...], ...] | None) -> dict[str, Any] | None:
    """``target_prompt_logprobs`` as Tinker's JSON tensor: int64 ``[len(prompt) - 1, K]``."""
    if rows is None:
        return None
    return {"data": [i for row in rows for i in row], "dtype": "int64", "shape": [len(rows), len(rows[0]) if rows else 0]}


def _multi_target_losses(body: dict[str, Any]) -> list[str]:
    """Losses the server takes (N, K) targets for: ``asyncsess serve`` says which; Tinker's service does not
    and takes them for ``cross_entropy`` (tinker-cookbook's top-K distillation sends them)."""
    losses = body.get("multi_target_losses")
    return [str(x) for x in losses] if isinstance(losses, list) else ["cross_entropy"]
