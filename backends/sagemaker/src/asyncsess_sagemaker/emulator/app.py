"""The ASGI app: both wire protocols on one port, routed from the botocore service models.

- Control plane (awsJson1.1): ``POST /`` with ``X-Amz-Target: SageMaker.<Operation>``.
- Runtime (rest-json): the paths in the runtime model's ``requestUri`` fields.
- ``/_emulator/...``: test hooks (fault settings, remote failure, per-session execution log), unsigned.

Every wire request must carry a SigV4 ``Authorization`` header (:mod:`.auth`); its access key's account is the one
whose sessions, model packages and groups the request sees (:class:`.accounts.Accounts`).

Every request body is checked against the operation's input shape (limits, enums and patterns included);
with ``check_responses`` every answer is checked against its output shape too.
"""

from __future__ import annotations

import json
import logging
import random
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
from botocore.model import OperationModel
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from asyncsess.backends import Backend, load_backend
from asyncsess.serve.json_body import loads, off_loop

from ..service_models import (
    CONTROL,
    HUB_OPERATIONS,
    MODEL_REGISTRY_OPERATIONS,
    TAG_OPERATIONS,
    TRAINING_SESSION_OPERATIONS,
    operation,
    runtime_model,
)
from ..shape_check import ShapeError, check_shape
from .accounts import Accounts
from .auth import caller_account
from .config import EmulatorConfig, FaultConfig
from .errors import AwsError, control_error_response, runtime_error_response
from .listing import check_applied
from .service import EmulatedService, chat_completion_id, chat_model

__all__ = ["create_app"]

log = logging.getLogger("asyncsess_sagemaker.emulator")

CONTROL_OPERATIONS = TRAINING_SESSION_OPERATIONS + MODEL_REGISTRY_OPERATIONS + HUB_OPERATIONS + TAG_OPERATIONS
_JSON11 = "application/x-amz-json-1.1"


async def _json_object(raw: bytes, error: Callable[[str], AwsError]) -> dict[str, Any]:
    """A request body as a JSON object (empty: ``{}``); not JSON (bad UTF-8, nested past the recursion
    limit included) or not an object is ``error(message)``, a 400, never the 500 of an emulator bug. A large body is
    decoded in a worker thread (on the event loop 12 MB stalled every other caller for over a second)."""
    return await off_loop(len(raw), _decoded, raw, error)


def _decoded(raw: bytes, error: Callable[[str], AwsError]) -> dict[str, Any]:
    try:
        body = loads(raw or b"{}")
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise error("The request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise error("The request body must be a JSON object")
    return body


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class _Faults:
    def __init__(self, config: FaultConfig) -> None:
        self.set(config)

    def set(self, config: FaultConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.injected: Counter[str] = Counter()  # "ThrottlingException", ... -> how many were answered

    def applies(self, op_name: str) -> bool:
        ops = self.config.operations
        return ops is None or op_name in ops

    async def before(self, op_name: str) -> None:
        if not self.applies(op_name):
            return
        if self.config.latency_s:
            await anyio.sleep(self.config.latency_s)
        if self.config.throttle_rate and self.rng.random() < self.config.throttle_rate:
            self.injected["ThrottlingException"] += 1
            raise AwsError.throttling()
        if self.config.internal_error_rate and self.rng.random() < self.config.internal_error_rate:
            self.injected["InternalServerException"] += 1
            raise AwsError.internal("Injected internal error")

    def lose_response(self, op_name: str) -> bool:
        lost = self.applies(op_name) and bool(self.config.lost_response_rate) and self.rng.random() < self.config.lost_response_rate
        if lost:
            self.injected["lost response"] += 1
        return lost

    def truncate_response(self, op_name: str, response: Response) -> Response:
        """``response``, or (at ``truncated_response_rate``) a 200 whose body is cut short."""
        rate = self.config.truncated_response_rate
        if not (self.applies(op_name) and rate and self.rng.random() < rate):
            return response
        self.injected["truncated response"] += 1
        body = bytes(response.body)
        return Response(body[: len(body) // 2], status_code=200, media_type=response.media_type)

    def report(self) -> dict[str, Any]:
        return {"config": self.config.model_dump(), "injected": dict(self.injected)}


async def _validate(model: OperationModel, params: dict[str, Any], size: int) -> None:
    """``params`` checked against the operation's input shape (in a worker thread when the body was ``size`` bytes
    past :data:`INLINE_BYTES`)."""
    await off_loop(size, _check_input, model, params)


def _check_input(model: OperationModel, params: dict[str, Any]) -> None:
    try:
        check_shape(params, model.input_shape)
    except ShapeError as err:
        raise AwsError.validation(str(err)) from None


def _check_output(model: OperationModel, out: dict[str, Any]) -> None:
    try:
        check_shape(out, model.output_shape)
    except ShapeError as err:
        raise AssertionError(f"emulator answer for {model.name} does not match the service model: {err}") from None


def create_app(inner: Backend | str = "mock://", config: EmulatorConfig | None = None) -> Starlette:
    """The emulator over ``inner`` (a Backend, or a URL for :func:`asyncsess.backends.base.load_backend`)."""
    config = config or EmulatorConfig()
    backend = load_backend(inner) if isinstance(inner, str) else inner
    accounts = Accounts(backend, config)
    faults = _Faults(config.faults)

    async def caller(request: Request) -> EmulatedService:
        """The service of the account that signed ``request``."""
        return accounts.service(caller_account(request, await request.body(), config))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await backend.open()
        async with anyio.create_task_group() as tg:
            await accounts.start(tg)
            app.state.accounts = accounts
            try:
                yield
            finally:
                tg.cancel_scope.cancel()
                with anyio.CancelScope(shield=True):
                    await accounts.shutdown()
                    await backend.aclose()

    # ------------------------------------------------------------------------ control plane

    control_ops = {name: operation(CONTROL, name) for name in CONTROL_OPERATIONS}

    async def control_plane(request: Request) -> Response:
        target = request.headers.get("x-amz-target", "")
        prefix, _, op_name = target.partition(".")
        model = control_ops.get(op_name)
        try:
            service = await caller(request)
            if prefix != "SageMaker" or model is None:
                raise AwsError("UnknownOperationException", f"Operation {target or '(no X-Amz-Target)'} is not supported by this emulator")
            content_type = request.headers.get("content-type", "")
            if content_type.partition(";")[0].strip().lower() != _JSON11:  # the protocol's only media type, as AWS routes it
                shown = json.dumps(content_type)[:64] if content_type else "(none)"
                raise AwsError("UnknownOperationException", f"Content-Type {shown} is not the AWS JSON 1.1 protocol's: send {_JSON11}")
            await faults.before(op_name)
            raw = await request.body()
            body = await _json_object(raw, lambda message: AwsError("SerializationException", message))
            await _validate(model, body, len(raw))
            check_applied(op_name, body)
            out = await getattr(service, _snake(op_name))(body)
            if config.check_responses:
                _check_output(model, out)
            if faults.lose_response(op_name):
                raise AwsError.internal("Injected lost response (the request was applied)")
        except AwsError as err:
            return control_error_response(err)
        except Exception as err:
            log.exception("emulator bug in %s", op_name)
            return control_error_response(AwsError.internal(f"Emulator error: {err!r}"))
        return faults.truncate_response(op_name, Response(json.dumps(out), media_type=_JSON11))

    # ------------------------------------------------------------------------------ runtime

    Handler = Callable[[EmulatedService, Request, dict[str, Any]], Awaitable[Response]]

    def runtime_route(model: OperationModel, handler: Handler) -> Route:
        async def endpoint(request: Request) -> Response:
            try:
                service = await caller(request)
                await faults.before(model.name)
                params: dict[str, Any] = dict(request.path_params)
                raw = b""
                if model.input_shape.serialization.get("payload") is None and request.method == "POST":
                    raw = await request.body()
                    params.update(await _json_object(raw, AwsError.validation))
                try:
                    await _validate(model, params, len(raw))
                except AwsError:
                    if model.name == "ExecuteTrainingOperation":
                        service.refused_training_operation(params)
                    raise
                response = await handler(service, request, params)
                if faults.lose_response(model.name):
                    raise AwsError.internal("Injected lost response (the request was applied)")
                return response if isinstance(response, StreamingResponse) else faults.truncate_response(model.name, response)
            except AwsError as err:
                return runtime_error_response(err)
            except Exception as err:
                log.exception("emulator bug in %s", model.name)
                return runtime_error_response(AwsError.internal(f"Emulator error: {err!r}"))

        path = model.http["requestUri"]
        return Route(path, endpoint, methods=[model.http["method"]], name=model.name)

    def json_handler(model: OperationModel) -> Handler:
        async def handle(service: EmulatedService, request: Request, params: dict[str, Any]) -> Response:
            out = await getattr(service, _snake(model.name))(params)
            if config.check_responses:
                _check_output(model, out)
            return JSONResponse(out)

        return handle

    runtime = runtime_model()
    package_header = runtime.shape_for("SampleTrainingSessionInput").members["modelPackageArn"].serialization["name"]

    async def chat_request(request: Request) -> tuple[dict[str, Any], str | None]:
        return await _json_object(await request.body(), AwsError.validation), request.headers.get(package_header)

    async def sample_handler(service: EmulatedService, request: Request, params: dict[str, Any]) -> Response:
        body, package = await chat_request(request)
        reply = await service.chat(params["trainingSessionName"], body, package)
        prompt, completion = reply.prompt, reply.completion
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(completion), "total_tokens": len(prompt) + len(completion)}
        logprobs = None if reply.logprobs is None else {"content": reply.logprobs}
        message = {"role": "assistant", "content": reply.text}
        return JSONResponse(
            {
                "id": chat_completion_id(),
                "object": "chat.completion",
                "created": int(time.time()),
                "model": chat_model(body),
                "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reply.finish}],
                "usage": usage,
            }
        )

    async def stream_handler(service: EmulatedService, request: Request, params: dict[str, Any]) -> Response:
        body, package = await chat_request(request)
        events = await service.chat_stream(params["trainingSessionName"], body, package)
        return StreamingResponse(events, media_type="text/event-stream")

    special = {"SampleTrainingSession": sample_handler, "SampleTrainingSessionWithResponseStream": stream_handler}
    routes = [
        runtime_route(runtime.operation_model(name), special.get(name) or json_handler(runtime.operation_model(name)))
        for name in runtime.operation_names
    ]

    # -------------------------------------------------------------------------------- admin

    async def hook_body(request: Request) -> dict[str, Any]:
        return await _json_object(await request.body(), AwsError.validation)

    async def set_faults(request: Request) -> Response:
        try:
            if request.method == "POST":
                try:
                    faults.set(FaultConfig.model_validate(await hook_body(request)))
                except ValidationError as err:
                    raise AwsError.validation(str(err)) from None
        except AwsError as err:
            return runtime_error_response(err)
        return JSONResponse(faults.report())

    def hooked(request: Request) -> EmulatedService:
        """The service of the account a test hook names (``?account=``; default: ``account_id``)."""
        account = request.query_params.get("account") or config.account_id
        if account not in accounts:
            raise AwsError.not_found(f"Account {account[:64]} has made no call")
        return accounts.service(account)

    async def session_state(request: Request) -> Response:
        try:
            return JSONResponse(hooked(request).session_state(request.path_params["name"]))
        except AwsError as err:
            return runtime_error_response(err)

    async def end_session(request: Request) -> Response:
        try:
            payload = await hook_body(request)
            status, reason = payload.get("status", "Failed"), payload.get("reason", "Failed by the emulator's test hook")
            if status not in ("Failed", "Expired") or not isinstance(reason, str):
                raise AwsError.validation("status must be Failed or Expired, and reason a string")
            service = hooked(request)
            service.fail_session(request.path_params["name"], reason, status)
        except AwsError as err:
            return runtime_error_response(err)
        return JSONResponse(service.session_state(request.path_params["name"]))

    async def unrouted(request: Request, exc: Exception) -> Response:
        """A path or method no operation has: AWS's ``UnknownOperationException``, not Starlette's plain text."""
        status = getattr(exc, "status_code", 404)
        return runtime_error_response(
            AwsError("UnknownOperationException", f"No operation is served at {request.method} {request.url.path[:256]}", status=status)
        )

    routes += [
        Route("/", control_plane, methods=["POST"]),
        Route("/_emulator/faults", set_faults, methods=["GET", "POST"]),
        Route("/_emulator/sessions/{name}", session_state, methods=["GET"]),
        Route("/_emulator/sessions/{name}/end", end_session, methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: unrouted, 405: unrouted})
