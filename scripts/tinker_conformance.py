"""Which public methods of the official tinker SDK work against `asyncsess serve` on mock://.

Discovers the public methods of ServiceClient, TrainingClient, SamplingClient and RestClient by
reflection, calls each one (its `_async` twin too) against a server started here on 127.0.0.1, checks the
answer, and writes the table to docs/tinker-conformance.md. A method counts as supported only when its
probe ran and its check held; a method without a probe is listed as unsupported ("no probe").

    python scripts/tinker_conformance.py            # regenerate docs/tinker-conformance.md
    python scripts/tinker_conformance.py --check    # fail when the table in docs/ is stale
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["TINKER_API_KEY"] = "tml-asyncsess-test"  # sampler handles carry no credentials, by design
warnings.simplefilter("ignore")

import tinker  # noqa: E402
from tinker import types  # noqa: E402

from tests.tinker.conftest import API_KEY, start_server  # noqa: E402

DOC = ROOT / "docs" / "tinker-conformance.md"
CLASSES = (tinker.ServiceClient, tinker.TrainingClient, tinker.SamplingClient, tinker.RestClient)
BASE = "mock/bigram-tiny"

# Methods this server does not offer, and why (their probes are not run).
UNSUPPORTED = {
    "ServiceClient.copy_weights": "cross-account weight copies are a hosted-service feature",
    "RestClient.copy_weights": "cross-account weight copies are a hosted-service feature",
    "ServiceClient.create_custom_loss": "server-side custom losses are off (flag custom_loss_server_side=false); "
    "forward_backward_custom runs them client-side",
    "TrainingClient.save_weights_external": "no export of merged weights to external storage",
    "RestClient.get_external_weights_urls": "no export of merged weights to external storage",
    "RestClient.export_session_trace": "no trace store",
    "RestClient.get_audit_log": "admin/billing API of the hosted service",
    "RestClient.get_billing_usage": "admin/billing API of the hosted service",
    "RestClient.get_current_checkpoint_storage_usage": "admin/billing API of the hosted service",
    "RestClient.whoami": "no user accounts (one API-key list)",
    "TrainingClient.get_tokenizer": "mock:// has a character tokenizer, not a Hugging Face one (works on local://)",
    "SamplingClient.get_tokenizer": "mock:// has a character tokenizer, not a Hugging Face one (works on local://)",
    "SamplingClient.create": "internal constructor (takes the SDK's client holder)",
}


def _datums() -> list[types.Datum]:
    toks = [5, 6, 7, 8, 9]
    return [
        types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 4})
    ]


class Ctx:
    def __init__(self, url: str, door: Any) -> None:
        self.url = url
        self.door = door
        self.sc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        self.tc = self.sc.create_lora_training_client(base_model=BASE, rank=4).result()
        self.tc.forward_backward(_datums(), "cross_entropy").result()
        self.tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        self.state = self.tc.save_state("conf-state").result().path
        self.sampler_path = self.tc.save_weights_for_sampler("conf-sampler").result().path
        self.sampler = asyncio.run(_await_all(self.sc.create_sampling_client_async(model_path=self.sampler_path)))
        self.rest = self.sc.create_rest_client()
        self.n = 0

    def fresh_name(self) -> str:
        self.n += 1
        return f"conf-{self.n}"

    def fresh_checkpoint(self) -> str:
        return self.tc.save_state(self.fresh_name()).result().path


def _value(res: Any) -> Any:
    if hasattr(res, "result") and callable(res.result) and not isinstance(res, (tinker.TrainingClient, tinker.SamplingClient)):
        return res.result()
    return res


async def _await_all(aw: Any) -> Any:
    res = await aw
    while inspect.isawaitable(res) and not isinstance(res, (tinker.TrainingClient, tinker.SamplingClient)):
        res = await res
    return res


def _is_path(p: Any) -> bool:
    return isinstance(getattr(p, "path", None), str) and p.path.startswith("tinker://")


def _sample_ok(r: Any) -> bool:
    return len(r.sequences) == 2 and all(len(s.tokens) >= 1 for s in r.sequences)


# name -> (call(ctx, method) -> result, check(result) -> bool); `method` is the bound method under test.
PROBES: dict[str, tuple[Callable[[Ctx, Any], Any], Callable[[Any], bool]]] = {
    # closes a second client (closing the probe's own would end the run); the server records the finish reason
    "ServiceClient.close": (lambda c, m: _close(c, m), lambda r: r == {"type": "success"}),
    "ServiceClient.create_lora_training_client": (lambda c, m: m(base_model=BASE, rank=4), lambda r: ":train:" in r.model_id),
    "ServiceClient.create_rest_client": (lambda c, m: m(), lambda r: isinstance(r, tinker.RestClient)),
    "ServiceClient.create_sampling_client": (lambda c, m: m(model_path=c.sampler_path), lambda r: isinstance(r, tinker.SamplingClient)),
    "ServiceClient.create_training_client_from_state": (lambda c, m: m(c.state), lambda r: ":train:" in r.model_id),
    "ServiceClient.create_training_client_from_state_with_optimizer": (lambda c, m: m(c.state), lambda r: ":train:" in r.model_id),
    "ServiceClient.get_console_url": (lambda c, m: m(), lambda r: isinstance(r, str)),
    "ServiceClient.get_server_capabilities": (lambda c, m: m(), lambda r: any(x.model_name == BASE for x in r.supported_models)),
    "ServiceClient.get_telemetry": (lambda c, m: m(), lambda r: r is None),
    "TrainingClient.create_sampling_client": (lambda c, m: m(c.sampler_path), lambda r: isinstance(r, tinker.SamplingClient)),
    "TrainingClient.forward": (lambda c, m: m(_datums(), "cross_entropy"), lambda r: r.metrics["loss:sum"] > 0),
    "TrainingClient.forward_backward": (lambda c, m: m(_datums(), "cross_entropy"), lambda r: len(r.loss_fn_outputs) == 1),
    "TrainingClient.forward_backward_custom": (
        lambda c, m: m(_datums(), lambda data, logprobs: (sum(-lp.sum() for lp in logprobs), {"n": float(len(logprobs))})),
        lambda r: r.metrics.get("n:sum", r.metrics.get("n")) is not None,
    ),
    "TrainingClient.get_console_url": (lambda c, m: m(), lambda r: isinstance(r, str)),
    "TrainingClient.get_info": (lambda c, m: m(), lambda r: r.model_data.model_name == BASE and r.lora_rank == 4),
    "TrainingClient.get_telemetry": (lambda c, m: m(), lambda r: r is None),
    "TrainingClient.load_state": (lambda c, m: m(c.state), lambda r: r.path == c_state[0]),
    "TrainingClient.load_state_with_optimizer": (lambda c, m: m(c.state), lambda r: r.path == c_state[0]),
    "TrainingClient.optim_step": (lambda c, m: m(types.AdamParams(learning_rate=1e-3)), lambda r: "grad_norm" in (r.metrics or {})),
    "TrainingClient.save_state": (lambda c, m: m(c.fresh_name()), _is_path),
    "TrainingClient.save_weights_and_get_sampling_client": (lambda c, m: m(), lambda r: isinstance(r, tinker.SamplingClient)),
    "TrainingClient.save_weights_for_sampler": (lambda c, m: m(c.fresh_name()), _is_path),
    "SamplingClient.compute_logprobs": (lambda c, m: m(types.ModelInput.from_ints([5, 6, 7])), lambda r: r[0] is None and len(r) == 3),
    "SamplingClient.from_sampler_handle": (
        lambda c, m: m(c.sampler.get_sampler_handle()).sample(types.ModelInput.from_ints([5]), 2, types.SamplingParams(max_tokens=2)),
        _sample_ok,
    ),
    "SamplingClient.get_base_model": (lambda c, m: m(), lambda r: r == BASE),
    "SamplingClient.get_sampler_handle": (lambda c, m: m(), lambda r: isinstance(r, str) and len(r) > 10),
    "SamplingClient.get_telemetry": (lambda c, m: m(), lambda r: r is None),
    "SamplingClient.on_queue_state_change": (lambda c, m: m(tinker.lib.api_future_impl.QueueState.ACTIVE, None), lambda r: r is None),
    "SamplingClient.sample": (lambda c, m: m(types.ModelInput.from_ints([5, 6]), 2, types.SamplingParams(max_tokens=3)), _sample_ok),
    "RestClient.assign_session_project": (lambda c, m: m(c.sc.holder.get_session_id(), "proj-1"), lambda r: True),
    "RestClient.delete_checkpoint": (
        lambda c, m: _delete_by_id(c, m),
        lambda r: r[0] not in r[1],
    ),
    "RestClient.delete_checkpoint_from_tinker_path": (lambda c, m: _delete_and_list(c, m), lambda r: r[0] not in r[1]),
    "RestClient.get_sampler": (lambda c, m: m(c.sampler._sampling_session_id), lambda r: r.base_model == BASE),
    "RestClient.get_server_capabilities": (lambda c, m: m(), lambda r: any(x.model_name == BASE for x in r.supported_models)),
    "RestClient.get_session": (lambda c, m: m(c.sc.holder.get_session_id()), lambda r: len(r.training_run_ids) >= 1),
    "RestClient.get_telemetry": (lambda c, m: m(), lambda r: r is None),
    "RestClient.get_training_run": (lambda c, m: m(c.tc.model_id), lambda r: r.base_model == BASE and r.lora_rank == 4),
    "RestClient.get_training_run_by_tinker_path": (lambda c, m: m(c.state), lambda r: r.base_model == BASE),
    "RestClient.get_weights_info_by_tinker_path": (lambda c, m: m(c.state), lambda r: r.base_model == BASE and r.lora_rank == 4),
    "RestClient.list_checkpoints": (
        lambda c, m: m(c.tc.model_id),
        lambda r: any(ck.checkpoint_id == "weights/conf-state" for ck in r.checkpoints),
    ),
    "RestClient.list_sessions": (lambda c, m: m(), lambda r: len(r.sessions) >= 1),
    "RestClient.search_sessions": (
        lambda c, m: m(types.SessionSearchRequest(session_id=c.sc.holder.get_session_id(), statuses=[types.ActiveSessionStatusQuery()])),
        lambda r: [s.status.type for s in r.sessions] == ["active"] and r.sessions[0].checkpoints_count >= 2,
    ),
    "RestClient.list_training_runs": (lambda c, m: m(), lambda r: len(r.training_runs) >= 1),
    "RestClient.list_user_checkpoints": (lambda c, m: m(), lambda r: len(r.checkpoints) >= 1),
    "RestClient.publish_checkpoint_from_tinker_path": (lambda c, m: _publish(c, m, True), lambda r: r is True),
    "RestClient.unpublish_checkpoint_from_tinker_path": (lambda c, m: _publish(c, m, False), lambda r: r is False),
    "RestClient.set_checkpoint_ttl_from_tinker_path": (
        lambda c, m: (_value(m(c.state, 7200)), c.rest.list_checkpoints(c.tc.model_id).result())[1],
        lambda r: any(ck.checkpoint_id == "weights/conf-state" and ck.expires_at is not None for ck in r.checkpoints),
    ),
}
c_state: list[str] = []

# Supported methods that never reach the server (they count, and the table says so).
CLIENT_SIDE = {
    "ServiceClient.get_console_url",
    "ServiceClient.get_telemetry",
    "TrainingClient.get_console_url",
    "TrainingClient.get_telemetry",
    "SamplingClient.get_telemetry",
    "SamplingClient.get_sampler_handle",
    "SamplingClient.on_queue_state_change",
    "RestClient.get_telemetry",
}


def _close(c: Ctx, m: Any) -> Any:
    other = tinker.ServiceClient(base_url=c.url, api_key=API_KEY)
    sid = other.holder.get_session_id()
    _value(type(m.__self__).close(other, "success"))
    return c.door.sessions[sid].finished["reason"]


def _delete_by_id(c: Ctx, m: Any) -> tuple[str, list[str]]:
    path = c.fresh_checkpoint()
    _value(m(c.tc.model_id, path.split("/", 3)[3]))
    return path, [ck.tinker_path for ck in c.rest.list_checkpoints(c.tc.model_id).result().checkpoints]


def _delete_and_list(c: Ctx, m: Any) -> tuple[str, list[str]]:
    path = c.fresh_checkpoint()
    _value(m(path))
    return path, [ck.tinker_path for ck in c.rest.list_checkpoints(c.tc.model_id).result().checkpoints]


def _publish(c: Ctx, m: Any, public: bool) -> bool:
    _value(m(c.state))
    return next(ck.public for ck in c.rest.list_checkpoints(c.tc.model_id).result().checkpoints if ck.tinker_path == c.state)


def public_methods() -> list[str]:
    out = []
    for cls in CLASSES:
        for name, member in inspect.getmembers(cls):
            if not name.startswith("_") and callable(member):
                out.append(f"{cls.__name__}.{name}")
    return sorted(out)


def _owner(ctx: Ctx, cls_name: str) -> Any:
    return {"ServiceClient": ctx.sc, "TrainingClient": ctx.tc, "SamplingClient": ctx.sampler, "RestClient": ctx.rest}[cls_name]


def _clean(text: str) -> str:
    text = re.sub(r"[0-9a-f]{8}-[0-9a-f-]{27}", "<id>", text.splitlines()[0] if text else "")
    return re.sub(r"127\.0\.0\.1:\d+", "<server>", text)[:160].replace("|", "/")


def probe(ctx: Ctx, full: str) -> tuple[bool, str]:
    cls_name, name = full.split(".")
    is_async = name.endswith("_async")
    base = f"{cls_name}.{name[:-6]}" if is_async else full
    if base in UNSUPPORTED:
        return False, UNSUPPORTED[base]
    if base not in PROBES:
        return False, "no probe"
    call, check = PROBES[base]
    method = getattr(_owner(ctx, cls_name), name)
    if is_async:
        coro_fn = method

        def method(*args: Any, **kw: Any) -> Any:
            return asyncio.run(_await_all(coro_fn(*args, **kw)))

        method.__self__ = coro_fn.__self__  # type: ignore[attr-defined]
    try:
        result = _value(call(ctx, method))
        ok = bool(check(result))
    except Exception as err:
        return False, f"{type(err).__name__}: {_clean(str(err))}"
    return (True, "") if ok else (False, "the answer failed its check")


def render(rows: list[tuple[str, bool, str]]) -> str:
    n_ok = sum(ok for _, ok, _ in rows)
    lines = [
        "# Tinker SDK conformance of `asyncsess serve` (mock://)",
        "",
        f"Generated by `scripts/tinker_conformance.py` against tinker=={tinker.__version__}; CI (`nox -s tinker`) fails when",
        "this table is stale. Each public method of ServiceClient, TrainingClient, SamplingClient and RestClient is",
        "called against a server on mock:// and its answer checked.",
        "",
        f"**{n_ok} of {len(rows)} public SDK methods supported.**",
        "",
        "| Method | Supported | Reason when not |",
        "|---|---|---|",
    ]
    n_client = sum(ok and name in CLIENT_SIDE for name, ok, _ in rows)
    lines.insert(7, f"({n_client} of them are client-side helpers that never reach the server; they are marked below.)")

    lines += [
        f"| `{name}` | {('yes (client-side)' if name in CLIENT_SIDE else 'yes') if ok else 'no'} | {reason} |" for name, ok, reason in rows
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="fail when docs/tinker-conformance.md differs")
    ap.add_argument("--min-supported", type=int, default=60)
    args = ap.parse_args()
    gen = start_server("mock://", poll_timeout=5.0)
    server = next(gen)
    try:
        ctx = Ctx(server.url, server.door)
        c_state.append(ctx.state)
        rows = [(m, *probe(ctx, m)) for m in public_methods()]
        ctx.sc.holder.close()
    finally:
        next(gen, None)
    text = render(rows)
    n_ok = sum(ok for _, ok, _ in rows)
    print(f"{n_ok} of {len(rows)} supported")
    if args.check:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC.relative_to(ROOT)} is stale: run python scripts/tinker_conformance.py", file=sys.stderr)
            return 1
    else:
        DOC.write_text(text)
    return 0 if n_ok >= args.min_supported else 2


if __name__ == "__main__":
    raise SystemExit(main())
