"""What a rollout worker in another process does with a pickled sampler (imported by the spawned child)."""

from __future__ import annotations

import asyncio
import pickle

PROMPT = [1, 40, 41]
PARAMS = {"max_tokens": 6, "seed": 3, "stop": []}


def sample_async_client(blob: bytes) -> list[list[int]]:
    sc = pickle.loads(blob)

    async def main() -> list[list[int]]:
        async with sc:
            resp = await sc.sample(PROMPT, 3, PARAMS)
            return [s.tokens for s in resp.sequences]

    return asyncio.run(main())


def sample_sync_client(blob: bytes) -> list[list[int]]:
    sc = pickle.loads(blob)
    return [s.tokens for s in sc.sample(PROMPT, 3, PARAMS).result().sequences]
