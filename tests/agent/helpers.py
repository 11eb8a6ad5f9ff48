"""A sampler with scripted replies scored by a real mock sampler's log-probs (to force tool calls and drift), and a
raw ASGI request scope for the tests that drive an app without a socket."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncsess.client import SamplingClient
from asyncsess.futures import APIFuture
from asyncsess.types import SampledSequence, SampleResponse, SamplingParams

CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]},
    },
}


class ScriptedSampler:
    """Wraps a real SamplingClient; ``sample`` answers the next scripted reply (then ``<|end|>``), scored by
    the real sampler's ``compute_logprobs``. Everything else is the real sampler's."""

    def __init__(self, real: SamplingClient, replies: Sequence[str]) -> None:
        self.real, self.replies = real, list(replies)
        self.sampler_id, self.base_model = real.sampler_id, real.base_model
        tok = real.get_tokenizer()
        self.end = tok.convert_tokens_to_ids("<|end|>")

    def get_tokenizer(self) -> Any:
        return self.real.get_tokenizer()

    def stats(self) -> Any:
        return self.real.stats()

    def compute_logprobs(self, prompt: Any) -> APIFuture[list[float | None]]:
        return self.real.compute_logprobs(prompt)

    def sample(self, prompt: list[int], num_samples: int = 1, sampling_params: SamplingParams | None = None) -> Any:
        text = self.replies.pop(0)
        tokens = [*self.get_tokenizer().encode(text, add_special_tokens=False), self.end]

        async def run() -> SampleResponse:
            lps = await self.real.compute_logprobs(list(prompt) + tokens)
            seq = SampledSequence(stop_reason="stop", tokens=tokens, logprobs=[float(x) for x in lps[len(prompt) :]])
            return SampleResponse(sequences=[seq] * num_samples)

        return run()


def post_scope(path: str, headers: list[tuple[bytes, bytes]], server: str = "front") -> dict[str, Any]:
    """The ASGI scope of a JSON ``POST`` to ``path`` with ``headers`` added (for driving an app by hand)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1),
        "server": (server, 80),
    }
