"""Backend-side helper: a sampler's recent answers by ``request_id``, for retries to fetch.

The client gives every logical sample request one ``SampleRequest.request_id`` and resends it with each
retry. A backend that keeps its answers in a :class:`SampleStore` answers such a retry from the store
(after a lost answer) instead of sampling again: the Sequencer's exactly-once rule, for samples.
"""

from __future__ import annotations

from collections import OrderedDict

from ..errors import ConflictError
from ..types import SampleResponse
from .base import SampleRequest

__all__ = ["SampleStore"]


class SampleStore:
    """The last ``keep`` answers of one sampler, by ``request_id``; the oldest goes first.

    A request without a ``request_id`` is never kept. A kept id sent with another request (prompt, count,
    sampling parameters, log-prob options) is a :class:`ConflictError`, as a Tinker-wire server answers a
    ``seq_id`` reused with another body with 409: serving the old answer would hide the caller's bug.
    """

    def __init__(self, keep: int = 1024) -> None:
        self.keep = keep
        self._answers: OrderedDict[str, tuple[SampleRequest, SampleResponse]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._answers)

    def lookup(self, request: SampleRequest) -> SampleResponse | None:
        """A copy of the kept answer to ``request`` (a retry), or ``None`` (a new request: sample it)."""
        kept = self._answers.get(request.request_id) if request.request_id else None
        if kept is None:
            return None
        if kept[0] != request:
            raise ConflictError(
                f"request_id {request.request_id!r} was already used for another sample request on this sampler",
                field="request_id",
                fix="give each new request its own request_id; reuse one only to retry the same request",
                operation="sample",
            )
        return kept[1].model_copy(deep=True)  # a fresh answer, as one off the wire would be

    def add(self, request: SampleRequest, response: SampleResponse) -> None:
        """Keep ``response`` as the answer to ``request`` (if it has a ``request_id``)."""
        if not request.request_id or self.keep <= 0:
            return
        self._answers[request.request_id] = (request, response)
        self._answers.move_to_end(request.request_id)
        while len(self._answers) > self.keep:
            self._answers.popitem(last=False)
