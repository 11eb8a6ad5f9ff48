"""SandboxFusionClient against a fake SandboxFusion server on 127.0.0.1 and against canned responses.

The fake mirrors SandboxFusion's RunCodeRequest/RunCodeResponse (bytedance/SandboxFusion,
sandbox/server/sandbox_api.py and sandbox/runners/types.py). Unlike the real server it rejects unknown request
fields (422), so a misspelt field fails the test. It runs the (trusted, test-written) code with the test's own
interpreter.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import anyio
import httpx
import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from asyncsess.errors import InvalidInputError
from asyncsess.retry import RetryPolicy
from asyncsess.sandbox import Sandbox, SandboxFusionClient, TestCase

pytestmark = pytest.mark.anyio

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
ADD_TESTS = [
    TestCase(stdin="1 2\n", expected_stdout="3\n"),
    TestCase(stdin="10 -4\n", expected_stdout="6"),
    TestCase(stdin="0 0", expected_stdout="0\n"),
]


class _RunCodeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    compile_timeout: float = 10
    run_timeout: float = 10
    memory_limit_MB: int = -1
    code: str
    stdin: str | None = None
    language: str
    files: dict[str, str | None] = {}
    fetch_files: list[str] = []
    args: list[str] = []


@contextlib.contextmanager
def _closed_port():
    """A free TCP port on 127.0.0.1 that nobody listens on, reserved for the block."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def _execute(request: _RunCodeRequest) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        for name, content in request.files.items():
            path = Path(workdir, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(base64.b64decode(content or ""))
        started = time.monotonic()
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-c", request.code],
                input=request.stdin or "",
                capture_output=True,
                text=True,
                timeout=request.run_timeout,
                cwd=workdir,
            )
            run = {"status": "Finished", "return_code": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
        except subprocess.TimeoutExpired:
            run = {"status": "TimeLimitExceeded", "return_code": None, "stdout": "", "stderr": ""}
        run["execution_time"] = time.monotonic() - started
    status = "Success" if run["return_code"] == 0 else "Failed"
    return {"status": status, "message": "", "compile_result": None, "run_result": run, "executor_pod_name": None, "files": {}}


class FakeSandboxFusion(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.requests: list[dict] = []
        self.fail_with: list[int] = []  # HTTP statuses to answer with, in order, before serving normally
        self.in_flight = 0
        self.peak = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: FakeSandboxFusion

    def log_message(self, *args) -> None:
        pass

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with server.lock:
            server.requests.append(body)
            failure = server.fail_with.pop(0) if server.fail_with else None
        if self.path != "/run_code":
            return self._reply(404, {"detail": "Not Found"})
        if failure is not None:
            return self._reply(failure, {"detail": "injected failure"})
        try:
            request = _RunCodeRequest.model_validate(body)
        except ValidationError as exc:
            return self._reply(422, {"detail": exc.errors(include_url=False, include_context=False)})
        with server.lock:
            server.in_flight += 1
            server.peak = max(server.peak, server.in_flight)
        try:
            response = _execute(request)
        finally:
            with server.lock:  # before replying: the client may send its next request as soon as it has the reply
                server.in_flight -= 1
        self._reply(200, response)


@pytest.fixture
def fake_server():
    server = FakeSandboxFusion()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


async def test_runs_programs_and_tests_through_the_server(fake_server):
    async with SandboxFusionClient(fake_server.url, timeout_s=2.0, memory_mb=512) as client:
        assert isinstance(client, Sandbox) and client.url == fake_server.url + "/run_code"
        result = await client.run(
            "import sys\nprint(open('data/x.txt').read().strip(), sys.stdin.read())", stdin="in", files={"data/x.txt": "hello"}
        )
        assert (result.status, result.exit_code, result.stdout) == ("ok", 0, "hello in\n")
        assert result.cpu_s is None and result.wall_s > 0
        sent = fake_server.requests[-1]
        assert sent["language"] == "python" and sent["run_timeout"] == 2.0 and sent["memory_limit_MB"] == 512
        assert sent["stdin"] == "in" and base64.b64decode(sent["files"]["data/x.txt"]) == b"hello"

        report = await client.run_tests(ADD, ADD_TESTS)
        assert report.all_passed and report.passed == 3
        wrong = await client.run_tests(ADD.replace("+", "*"), ADD_TESTS)
        assert [r.passed for r in wrong.results] == [False, False, True]

        failing = await client.run("raise KeyError('k')")
        assert failing.status == "runtime_error" and failing.exit_code == 1 and "KeyError" in failing.stderr
        slow = await client.run("import time\ntime.sleep(30)", timeout_s=0.5)
        assert slow.status == "timeout"


async def test_transient_failures_are_retried(fake_server):
    fake_server.fail_with = [503, 429]
    async with SandboxFusionClient(fake_server.url, retry=RetryPolicy(max_attempts=3, initial_backoff=0.01)) as client:
        result = await client.run("print('after retries')")
    assert (result.status, result.stdout) == ("ok", "after retries\n")
    assert len(fake_server.requests) == 3


async def test_persistent_failure_becomes_sandbox_error(fake_server):
    fake_server.fail_with = [500, 500, 500]
    async with SandboxFusionClient(fake_server.url, retry=RetryPolicy(max_attempts=2, initial_backoff=0.01)) as client:
        result = await client.run("print(1)")
        assert result.status == "sandbox_error" and "500" in result.stderr
        assert len(fake_server.requests) == 2
        fake_server.fail_with = [400]  # a client error is not retried
        bad = await client.run("print(1)")
        assert bad.status == "sandbox_error" and len(fake_server.requests) == 3
        healthy = await client.run("print(1)")  # and the client still works
        assert healthy.status == "ok"


async def test_unreachable_server_is_a_sandbox_error():
    with _closed_port() as port:
        async with SandboxFusionClient(f"http://127.0.0.1:{port}/run_code", retry=RetryPolicy.none()) as client:
            result = await client.run("print(1)")
    assert result.status == "sandbox_error" and "connect" in result.stderr.lower()


async def test_bad_input_is_a_typed_error_before_any_request(fake_server):
    """As with LocalSandbox: a bad limit, text that is not valid Unicode or a bad file is an InvalidInputError naming
    the field (it was a sandbox_error from the server's 4xx, or a TypeError from base64 of a non-bytes file)."""
    for field, value in (("timeout_s", math.nan), ("timeout_s", -1), ("memory_mb", 1.5), ("max_concurrency", 0)):
        with pytest.raises(InvalidInputError) as caught:
            SandboxFusionClient(fake_server.url, **{field: value})
        assert caught.value.field == field
    async with SandboxFusionClient(fake_server.url) as client:
        runs = [
            ({"code": "print('\ud800')"}, "code"),
            ({"code": "print(1)", "stdin": "\udfff"}, "stdin"),
            ({"code": b"print(1)"}, "code"),
            ({"code": "print(1)", "timeout_s": math.inf}, "timeout_s"),
            ({"code": "print(1)", "memory_mb": True}, "memory_mb"),
            ({"code": "print(1)", "files": {"../x": "y"}}, "files"),
            ({"code": "print(1)", "files": {"/etc/x": "y"}}, "files"),
            ({"code": "print(1)", "files": {"a": 5}}, "files"),
            ({"code": "print(1)", "files": {"a": "\ud800"}}, "files"),
            ({"code": "print(1)", "files": {"a": "x", "a/b": "y"}}, "files"),
        ]
        for kwargs, field in runs:
            code = kwargs.pop("code")
            with pytest.raises(InvalidInputError) as caught:
                await client.run(code, **kwargs)
            assert caught.value.field == field, (kwargs, field)
        assert fake_server.requests == []  # nothing was sent
        ok = await client.run("print(open('d/in.txt').read())", files={"d/in.txt": b"bytes ok"})
        assert (ok.status, ok.stdout) == ("ok", "bytes ok\n")


async def test_concurrency_is_bounded_and_fifty_requests_complete(fake_server):
    async with SandboxFusionClient(fake_server.url, max_concurrency=4) as client:
        results = {}

        async def one(i: int) -> None:
            results[i] = await client.run("import time\nn = int(input())\ntime.sleep(0.05)\nprint(n + 1)", stdin=str(i))

        async with anyio.create_task_group() as tg:
            for i in range(50):
                tg.start_soon(one, i)
    assert all((results[i].status, results[i].stdout) == ("ok", f"{i + 1}\n") for i in range(50))
    assert 2 <= fake_server.peak <= 4


def _canned(payload: dict | str, status: int = 200) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(payload, str):
            return httpx.Response(status, text=payload)
        return httpx.Response(status, json=payload)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


@pytest.mark.parametrize("hint", ["²", "nan", "-1", "1e400", "soon", "0x10"])
async def test_a_hostile_retry_after_is_ignored_and_the_call_retried(hint):
    """A 503's ``Retry-After`` that is no wait (a superscript digit, NaN, negative, infinite, text) is read as none."""
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) == 1:
            return httpx.Response(503, headers={"Retry-After": hint.encode()}, text="busy")
        return httpx.Response(200, json=_response("Success", _run(stdout="7\n")))

    retry = RetryPolicy(max_attempts=2, initial_backoff=0.01)
    client = SandboxFusionClient("http://sandbox.invalid", retry=retry, client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    result = await client.run("code")
    assert (result.status, result.stdout, len(calls)) == ("ok", "7\n", 2)


async def test_output_that_was_not_utf8_comes_back_replaced_not_as_a_sandbox_error():
    """A server that escapes undecodable output as a lone surrogate (``\\udcff``): the program's verdict stands."""
    body = json.dumps(_response("Success", _run(stdout="7\udcff\n", stderr="\ud800")))
    assert "\\udcff" in body
    client = SandboxFusionClient("http://sandbox.invalid", retry=RetryPolicy.none(), client=_canned(body))
    result = await client.run("code")
    assert (result.status, result.stdout, result.stderr) == ("ok", "7\ufffd\ufffd\ufffd\n", "\ufffd\ufffd\ufffd")
    result.stdout.encode("utf-8")  # no lone surrogate is left


def _response(status: str, run: dict | None, message: str = "") -> dict:
    return {"status": status, "message": message, "compile_result": None, "run_result": run, "executor_pod_name": None, "files": {}}


def _run(status: str = "Finished", return_code: int | None = 0, stdout: str = "", stderr: str = "") -> dict:
    return {"status": status, "execution_time": 0.25, "return_code": return_code, "stdout": stdout, "stderr": stderr}


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (_response("Success", _run(stdout="7\n")), "ok"),
        (_response("Failed", _run(return_code=1, stderr="Traceback ...\nZeroDivisionError: division by zero\n")), "runtime_error"),
        (_response("Failed", _run(return_code=1, stderr="Traceback ...\n    x = [0] * 10**10\nMemoryError\n")), "memory"),
        (_response("Failed", _run(status="TimeLimitExceeded", return_code=None)), "timeout"),
        (_response("SandboxError", _run(status="Error", return_code=None), message="pod died"), "sandbox_error"),
        (_response("SandboxError", None, message="exception on running code"), "sandbox_error"),
        (_response("Success", _run(stdout="x" * 5000)), "output_limit"),
        ("<html>bad gateway page</html>", "sandbox_error"),
    ],
)
async def test_responses_map_to_execution_results(payload, expected):
    client = SandboxFusionClient("http://sandbox.invalid", max_output_bytes=1000, retry=RetryPolicy.none(), client=_canned(payload))
    result = await client.run("code")
    assert result.status == expected, result
    if expected == "output_limit":
        assert len(result.stdout) == 1000
    if expected == "ok":
        assert (result.stdout, result.exit_code, result.wall_s) == ("7\n", 0, 0.25)
    if isinstance(payload, dict) and payload["message"]:
        assert payload["message"] in result.stderr


def test_url_defaults_to_the_cookbook_environment_variable(monkeypatch):
    monkeypatch.setenv("SANDBOX_URL", "http://sandbox.example:9000/")
    assert SandboxFusionClient().url == "http://sandbox.example:9000/run_code"
    monkeypatch.delenv("SANDBOX_URL")
    assert SandboxFusionClient().url == "http://localhost:8080/run_code"
