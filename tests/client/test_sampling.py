"""Concurrent sampling through the bounded pool, with observable backpressure."""

import threading

import pytest

from asyncsess import SamplingParams, ServiceClient

from .helpers import count_concurrency, until

pytestmark = pytest.mark.anyio


async def test_32_samples_are_in_flight_at_once(monkeypatch):
    async with ServiceClient("mock://?latency_ms=100") as svc:
        sc = await svc.create_sampling_client(base_model="mock/bigram-tiny")
        hold = threading.Event()
        state = count_concurrency(svc.backend, monkeypatch, hold=hold)
        futures = [sc.sample([1, 40, 41], 2, SamplingParams(max_tokens=4, seed=i)) for i in range(32)]
        assert sc.stats().in_flight + sc.stats().queued <= 32
        assert await until(lambda: state["now"] == 32), "all 32 requests must reach the backend concurrently"
        hold.set()
        results = [await f for f in futures]
        assert all(len(r.sequences) == 2 for r in results)  # wall time vs serial: bench/bench_client.py


async def test_pool_bounds_in_flight_requests_and_reports_the_queue(monkeypatch):
    async with ServiceClient("mock://?latency_ms=30", max_samples_in_flight=4) as svc:
        sc = await svc.create_sampling_client(base_model="mock/bigram-tiny")
        hold = threading.Event()
        state = count_concurrency(svc.backend, monkeypatch, hold=hold)
        futures = [sc.sample([1, 40], 1, SamplingParams(max_tokens=2)) for _ in range(12)]
        assert await until(lambda: state["now"] == 4 and sc.stats().queued == 8)
        assert sc.stats().in_flight == 4
        hold.set()
        for f in futures:
            await f
        stats = sc.stats()
        assert state["peak"] == 4 and stats.peak_in_flight == 4 and stats.waited == 8
        assert stats.completed == 12 and stats.in_flight == 0


async def test_pool_bounds_bytes(monkeypatch):
    async with ServiceClient("mock://?latency_ms=20", max_sample_bytes=8 * 10) as svc:
        sc = await svc.create_sampling_client(base_model="mock/bigram-tiny")
        state = count_concurrency(svc.backend, monkeypatch)
        futures = [sc.sample([1] + [40] * 5, 1, SamplingParams(max_tokens=1)) for _ in range(6)]  # 6 tokens = 48 bytes each
        for f in futures:
            await f
        assert state["peak"] == 1


async def test_cancelled_sample_frees_its_slot():
    async with ServiceClient("mock://?latency_ms=200", max_samples_in_flight=1) as svc:
        sc = await svc.create_sampling_client(base_model="mock/bigram-tiny")
        slow = sc.sample([1, 40], 1, SamplingParams(max_tokens=2))
        queued = sc.sample([1, 40], 1, SamplingParams(max_tokens=2))
        assert await until(lambda: sc.stats().in_flight == 1 and sc.stats().queued == 1)
        assert slow.cancel() and queued.cancel()
        assert await until(lambda: sc.stats().in_flight == 0 and sc.stats().queued == 0)
        assert slow.cancelled() and queued.cancelled()
        ok = await sc.sample([1, 40], 1, SamplingParams(max_tokens=2))
        assert len(ok.sequences) == 1
