"""The mock:// client suite, re-run with every ``mock://...`` URL routed over the Tinker wire.

Each ``ServiceClient("mock://?q")`` in the imported tests gets a ``tinker://`` backend talking to an
``asyncsess serve`` app whose backend is ``mock://?q`` (one server per distinct URL), so the same
assertions check the tinker:// driver and the door together. Tests that inspect the mock backend object
itself (``svc.backend.weights(...)``, fault counters) are listed in ``NOT_OVER_WIRE`` with the reason and not collected here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import asyncsess.client
from asyncsess.backends import load_backend
from asyncsess_tinker import TinkerBackend

# Re-collected here under the wire fixture below.
from tests.client.test_checkpoints import *  # noqa: F403
from tests.client.test_futures import *  # noqa: F403
from tests.client.test_lifecycle import *  # noqa: F403
from tests.client.test_ordering import *  # noqa: F403
from tests.client.test_rl import *  # noqa: F403
from tests.client.test_sampling import *  # noqa: F403
from tests.client.test_validation import *  # noqa: F403

from .conftest import API_KEY, Server, start_server

pytestmark = [pytest.mark.tinker, pytest.mark.anyio]

NOT_OVER_WIRE: dict[str, str] = {
    "test_resume_with_optimizer_is_bit_exact_and_weights_only_resets_moments": "asserts the mock:// checkpoint path format",
    "test_normal_exit_stops_every_session": "compares the client's ids with MockBackend.open_sessions(); the door's own stop is tested below",
    "test_exception_exit_stops_every_session": "compares the client's ids with MockBackend.open_sessions()",
    "test_task_cancellation_stops_every_session": "compares the client's ids with MockBackend.open_sessions()",
    "test_keyboard_interrupt_stops_every_session": "compares the client's ids with MockBackend.open_sessions()",
    "test_garbage_collected_client_warns_and_its_session_is_stopped": "compares the client's ids with MockBackend.open_sessions()",
    "test_a_dropped_client_is_stopped_by_the_heartbeat_without_another_call": "compares the client's ids with MockBackend.open_sessions()",
    "test_a_url_that_cannot_name_a_backend_is_refused_naming_it": "checks how the client parses mock:// and http:// URLs themselves",
    "test_a_mock_option_given_by_keyword_is_checked_as_the_url_is": "checks mock://'s own keyword options",
}

for _name in NOT_OVER_WIRE:  # not collected here (they run on mock:// in tests/client)
    globals().pop(_name)


class WitnessedTinkerBackend(TinkerBackend):
    """The tinker:// driver plus read-only views of the server's mock backend, named by tinker model ids,
    so the suite's white-box assertions (``svc.backend.weights(model_id)``, ``applied_log``) still hold."""

    def __init__(self, server: Server, **kw: Any) -> None:
        super().__init__(server.url, API_KEY, **kw)
        self._server = server

    def _mock_id(self, model_id: str) -> str:
        return self._server.door.models[model_id].backend_id

    def weights(self, model_id: str) -> Any:
        return self._server.backend.weights(self._mock_id(model_id))

    def optimizer_state(self, model_id: str) -> Any:
        return self._server.backend.optimizer_state(self._mock_id(model_id))

    @property
    def applied_log(self) -> list[tuple[str, int, str]]:
        names = {m.backend_id: mid for mid, m in self._server.door.models.items()}
        return [(names[sid], seq, kind) for sid, seq, kind in self._server.backend.applied_log if sid in names]


@pytest.fixture(scope="module")
def _servers() -> Iterator[dict[str, tuple[Server, Iterator[Server]]]]:
    servers: dict[str, tuple[Server, Iterator[Server]]] = {}
    yield servers
    for _, gen in servers.values():
        next(gen, None)


@pytest.fixture(autouse=True)
def _over_the_wire(monkeypatch: pytest.MonkeyPatch, _servers: dict[str, Any]) -> None:
    def routed(url: str, **options: Any):
        if not url.startswith("mock://"):
            return load_backend(url, **options)
        if url not in _servers:
            gen = start_server(url, poll_timeout=5.0)
            _servers[url] = (next(gen), gen)
        server = _servers[url][0]
        return WitnessedTinkerBackend(server, tokenizer=server.backend.get_tokenizer("mock/bigram-tiny"))

    monkeypatch.setattr(asyncsess.client, "load_backend", routed)
