"""Sessions stop on every exit path; stop() is idempotent; a garbage-collected client warns and stops."""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import textwrap

import anyio
import pytest

from asyncsess import ServiceClient, SessionGoneError
from asyncsess.rl.data import sft_datum
from asyncsess_mock import MockBackend

from .helpers import until

pytestmark = pytest.mark.anyio


def _open() -> set[str]:
    return set(MockBackend.open_sessions())


async def _open_two(svc: ServiceClient) -> set[str]:
    tc = await svc.create_lora_training_client("m", rank=4)
    sc = await tc.save_weights_and_get_sampling_client()
    return {tc.model_id, sc.sampler_id}


async def test_normal_exit_stops_every_session():
    async with ServiceClient("mock://") as svc:
        ids = await _open_two(svc)
        assert ids <= _open()
    assert not ids & _open()


async def test_exception_exit_stops_every_session():
    ids: set[str] = set()
    with pytest.raises(ZeroDivisionError):
        async with ServiceClient("mock://") as svc:
            ids = await _open_two(svc)
            1 / 0  # noqa: B018
    assert ids and not ids & _open()


async def test_task_cancellation_stops_every_session():
    ids: set[str] = set()
    steps = 0
    with anyio.CancelScope() as scope:
        async with ServiceClient("mock://?latency_ms=20") as svc:
            ids = await _open_two(svc)
            tc = await svc.create_lora_training_client("m", rank=4)
            ids.add(tc.model_id)
            while True:
                fb = tc.forward_backward([sft_datum([1, 40], [41])])
                steps += 1
                if steps == 3:
                    scope.cancel()  # cancelled while the op is in flight
                await fb
    assert scope.cancelled_caught and steps == 3
    assert len(ids) == 3 and not ids & _open()


async def test_keyboard_interrupt_stops_every_session():
    ids: set[str] = set()
    with pytest.raises(KeyboardInterrupt):
        async with ServiceClient("mock://") as svc:
            ids = await _open_two(svc)
            raise KeyboardInterrupt
    assert ids and not ids & _open()


async def test_stop_is_idempotent_and_later_ops_fail_typed():
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("m", rank=4)
        async with tc:
            await tc.forward_backward([sft_datum([1, 40], [41])])
        assert tc.model_id not in _open()
        await tc.stop()
        await tc.stop()
        with pytest.raises(SessionGoneError):
            tc.forward_backward([sft_datum([1, 40], [41])])


async def test_garbage_collected_client_warns_and_its_session_is_stopped():
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("m", rank=4)
        model_id = tc.model_id
        with pytest.warns(ResourceWarning, match=model_id):
            del tc
            gc.collect()
        other = await svc.create_lora_training_client("m", rank=4)  # the next call stops orphans
        assert await until(lambda: model_id not in _open())
        await other.stop()


async def test_a_dropped_client_is_stopped_by_the_heartbeat_without_another_call():
    """No further call on the ServiceClient: the heartbeat stops orphaned sessions on its next tick."""
    async with ServiceClient("mock://", heartbeat_interval=0.02) as svc:
        keep = await svc.create_lora_training_client("m", rank=4)
        tc = await svc.create_lora_training_client("m", rank=4)
        sampler = await keep.save_weights_and_get_sampling_client()
        dropped = {tc.model_id, sampler.sampler_id}
        assert dropped <= _open()
        with pytest.warns(ResourceWarning):
            del tc, sampler
            gc.collect()
        for _ in range(500):  # polls until stopped; the bound only keeps a broken build from hanging
            if not dropped & _open():
                break
            await anyio.sleep(0.02)
        assert not dropped & _open()
        assert keep.model_id in _open()  # the live client was left alone
        await keep.forward_backward([sft_datum([1, 40], [41])])


def test_ctrl_c_in_a_blocking_script_stops_the_session(tmp_path):
    """A real SIGINT while the sync facade blocks in .result(): the `with` block stops the session."""
    marker = tmp_path / "state"
    script = textwrap.dedent(
        f"""
        import signal, sys
        # a shell without job control starts background jobs with SIGINT ignored, and children inherit that
        # (`nohup nox &` would then hang here): give the script Python's own Ctrl-C handler, as a terminal does
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from asyncsess.sync import ServiceClient
        from asyncsess_mock import MockBackend
        from asyncsess.rl.data import sft_datum
        try:
            with ServiceClient("mock://?latency_ms=60000") as svc:
                tc = svc.create_lora_training_client("m", rank=4)
                print("ready", flush=True)
                tc.forward_backward([sft_datum([1, 40], [41])]).result()
        except KeyboardInterrupt:
            open({str(marker)!r}, "w").write(",".join(MockBackend.open_sessions()) or "none")
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    assert marker.read_text() == "none"
