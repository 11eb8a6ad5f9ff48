"""Generate docs/compatibility.md: both anchors' public training-session surface, row by row, against asyncsess.

Imports the pinned official packages (``tinker==0.38.0``, ``sagemaker-train==1.27.0``; the ``compat`` extra)
and walks by reflection their clients (methods and each parameter's name, kind and default), futures, public
type fields and error classes. Each row gets asyncsess's equivalent and a status:

- ``same``: the name exists; a parameter is accepted under the same name, at the same position when the
  anchor passes it positionally, with the same default;
- ``ignored``: accepted and ignored, for the reason given;
- ``differs`` / ``missing``: for the reason given (``REASONS`` below; a row without one says so).

Run ``python scripts/gen_compat.py`` (or ``nox -s tinker``); ``--check`` exits 1 when the file is stale.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
TARGET = ROOT / "docs" / "compatibility.md"

from compat_reasons import REASONS  # noqa: E402  (scripts/compat_reasons.py)

import asyncsess  # noqa: E402
import asyncsess.errors  # noqa: E402
import asyncsess.sync  # noqa: E402
from asyncsess import client as aclient  # noqa: E402
from asyncsess import types as atypes  # noqa: E402
from asyncsess._facade import SyncFuture  # noqa: E402

SAME, IGNORED, DIFFERS, MISSING, REFUSED = "same", "ignored", "differs", "missing", "refused"

# Parameter names that mean the same thing: at a position where the anchor has one and asyncsess the other,
# both the positional call and the anchor's keyword work with the anchor's meaning.
ALIASES = {
    frozenset({"data", "batch"}),
    frozenset({"optim_params", "adam_params"}),
    frozenset({"path", "model_package_arn"}),
    frozenset({"model_path", "model_package_arn"}),
    frozenset({"loss_fn_config", "loss_fn_inputs"}),  # told apart by content (per-token arrays vs scalars)
    frozenset({"loss_fn_inputs", "loss_fn_config"}),
}
_EMPTY = inspect.Parameter.empty


@dataclasses.dataclass
class Row:
    anchor: str  # "tinker" | "sagemaker"
    area: str  # ServiceClient, TrainingClient, SamplingClient, RestClient, futures, types, errors
    member: str  # e.g. "TrainingClient.save_state(name)"
    anchor_text: str  # kind/default as the anchor has it
    ours: str  # the asyncsess equivalent
    status: str
    reason: str = ""


# ------------------------------------------------------------------------------------ anchors


def _anchors() -> dict[str, dict[str, Any]]:
    import sagemaker.train.training_session as ts
    import tinker
    import tinker.types as tt

    return {
        "tinker": {
            "version": tinker.__version__,
            "clients": {
                "ServiceClient": tinker.ServiceClient,
                "TrainingClient": tinker.TrainingClient,
                "SamplingClient": tinker.SamplingClient,
                "RestClient": tinker.RestClient,
            },
            "future": tinker.APIFuture,
            "types": {
                n: getattr(tt, n)
                for n in (
                    "Datum",
                    "ModelInput",
                    "EncodedTextChunk",
                    "TensorData",
                    "SamplingParams",
                    "AdamParams",
                    "ForwardBackwardOutput",
                    "OptimStepResponse",
                    "SampleResponse",
                    "SampledSequence",
                    "Checkpoint",
                    "TrainingRun",
                    "Cursor",
                    "CheckpointsListResponse",
                    "TrainingRunsResponse",
                    "GetInfoResponse",
                    "SaveWeightsResponse",
                    "SaveWeightsForSamplerResponse",
                )
            },
            "errors": [n for n in tinker.__all__ if n.endswith("Error")],
            "error_module": tinker,
            "functions": {},
        },
        "sagemaker": {
            "version": _version("sagemaker-train"),
            "clients": {"ServiceClient": ts.ServiceClient, "TrainingClient": ts.TrainingClient, "SamplingClient": ts.SamplingClient},
            "future": ts.APIFuture,
            "types": {
                n: getattr(ts, n)
                for n in (
                    "Datum",
                    "ModelInput",
                    "EncodedTextChunk",
                    "TensorData",
                    "SamplingParams",
                    "AdamParams",
                    "ForwardBackwardOutput",
                    "OptimStepResponse",
                    "SampleResponse",
                    "SampledSequence",
                    "SaveStateResponse",
                    "SaveWeightsResponse",
                    "LoadStateResponse",
                    "ModelPackageInfo",
                    "ModelPackageDeletion",
                    "TrainingSessionSummary",
                    "TokenLogprob",
                )
            },
            "errors": [
                n
                for n, v in vars(ts.exceptions).items()
                if isinstance(v, type) and issubclass(v, BaseException) and v.__module__ == ts.exceptions.__name__
            ],
            "error_module": ts.exceptions,
            "functions": {"is_retryable": ts.is_retryable},
        },
    }


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


# ------------------------------------------------------------------------------------ ours


OUR_CLIENTS = {
    "ServiceClient": aclient.ServiceClient,
    "TrainingClient": aclient.TrainingClient,
    "SamplingClient": aclient.SamplingClient,
    "RestClient": aclient.RestClient,
}


def _public_methods(cls: type) -> Iterator[tuple[str, Callable[..., Any]]]:
    for name, member in sorted(inspect.getmembers(cls)):
        if name.startswith("_") or isinstance(inspect.getattr_static(cls, name), property):
            continue
        if callable(member):
            yield name, member


def _params(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [p for p in sig.parameters.values() if p.name not in ("self", "cls")]


def _fmt_default(p: inspect.Parameter) -> str:
    kind = {
        p.POSITIONAL_ONLY: "positional",
        p.POSITIONAL_OR_KEYWORD: "positional",
        p.KEYWORD_ONLY: "keyword",
        p.VAR_POSITIONAL: "*args",
        p.VAR_KEYWORD: "**kwargs",
    }[p.kind]
    if p.default is _EMPTY:
        return kind
    d = repr(p.default)
    return f"{kind}, `{d if len(d) < 40 else d[:37] + '...'}`"


def _reason(anchor: str, key: str) -> tuple[str, str] | None:
    """The recorded reason for a row; a key ending in ``*`` covers every member it starts (e.g. the ``_async`` twins)."""
    for who in (anchor, "*"):
        if f"{who}:{key}" in REASONS:
            return REASONS[f"{who}:{key}"]
    best = max(
        (k for k in REASONS if k.endswith("*") and any(f"{w}:{key}".startswith(k[:-1]) for w in (anchor, "*"))), key=len, default=None
    )
    return REASONS[best] if best else None


def _forward_target(cls: type | None, name: str, ours: Callable[..., Any]) -> Callable[..., Any]:
    """An ``X_async`` twin that passes ``*args, **kwargs`` on is compared with ``X``'s parameters."""
    if cls is not None and name.endswith("_async") and any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in _params(ours)):
        return getattr(cls, name[: -len("_async")], ours)
    return ours


def _compare_params(
    anchor: str, area: str, name: str, theirs: Callable[..., Any], ours: Callable[..., Any], original: Callable[..., Any] | None = None
) -> Iterator[Row]:
    our_params = _params(ours)
    entry_params = _params(original or ours)
    by_name = {p.name: p for p in our_params if p.kind is not p.POSITIONAL_ONLY}
    our_positional = [p.name for p in our_params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in our_params)
    position = 0
    for p in _params(theirs):
        key = f"{area}.{name}({p.name})"
        text = _fmt_default(p)
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            has = any(q.kind is p.kind for q in entry_params) or any(q.kind is p.kind for q in our_params)
            yield _row(anchor, area, key, text, "—", SAME if has else MISSING)
            continue
        mine = by_name.get(p.name)
        status, ours_text = SAME, ""
        if mine is None:
            status, ours_text = (IGNORED, "`**kwargs`") if takes_kwargs else (MISSING, "—")
        else:
            ours_text = _fmt_default(mine)
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                # by position and by keyword: our parameter at that position may carry another name as long as
                # the anchor's name is also accepted as a keyword (e.g. SageMaker's batch= next to Tinker's data)
                if position >= len(our_positional):
                    status = DIFFERS
                elif our_positional[position] != p.name:
                    ours_text = f"position {position} (`{our_positional[position]}`) or `{p.name}=`"
                    if frozenset({p.name, our_positional[position]}) not in ALIASES:
                        status = DIFFERS
            if mine.default is not _EMPTY and p.default is not _EMPTY and not _same_default(p.default, mine.default):
                status = DIFFERS
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            position += 1
        yield _row(anchor, area, key, text, ours_text, status)


def _same_default(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b) or (a is None and b is None)
    except Exception:
        return False


def _row(anchor: str, area: str, key: str, text: str, ours: str, status: str) -> Row:
    row = Row(anchor, area, key, text, ours, status)
    found = _reason(anchor, key)
    if found is not None and found[0] == REFUSED:  # present, but it raises UnsupportedError
        row.status, row.reason = found
    elif status != SAME:
        if found is not None:
            row.status, row.reason = found
        else:
            row.reason = "(no reason recorded)"
    return row


def _client_rows(anchor: str, spec: dict[str, Any]) -> Iterator[Row]:
    for area, cls in spec["clients"].items():
        ours_cls = OUR_CLIENTS.get(area)
        sync_cls = getattr(asyncsess.sync, area, None)
        for name, fn in _public_methods(cls):
            key = f"{area}.{name}"
            mine = getattr(ours_cls, name, None) if ours_cls is not None else None
            if mine is None:
                yield _row(anchor, area, key, "method", "—", MISSING)
                continue
            where = [f"`asyncsess.{area}.{name}`"]
            if sync_cls is not None and hasattr(sync_cls, name):
                where.append("sync")
            target = _forward_target(ours_cls, name, mine)
            if target is not mine:
                where.append(f"passes on to `{target.__name__}`")
            yield _row(anchor, area, key, "method", " + ".join(where), SAME)
            yield from _compare_params(anchor, area, name, fn, target, mine)


def _future_rows(anchor: str, spec: dict[str, Any]) -> Iterator[Row]:
    fut = spec["future"]
    for name, fn in _public_methods(fut):
        key = f"APIFuture.{name}"
        blocking = getattr(SyncFuture, name, None)
        awaitable = getattr(asyncsess.APIFuture, name, None)
        if blocking is None and awaitable is None:
            yield _row(anchor, "futures", key, "method", "—", MISSING)
            continue
        mine = blocking if blocking is not None and name != "result_async" else awaitable
        label = "`SyncFuture." + name + "`" if mine is blocking else "`APIFuture." + name + "`"
        yield _row(anchor, "futures", key, "method", label, SAME)
        yield from _compare_params(anchor, "futures", f"APIFuture.{name}".split(".", 1)[1], fn, mine)


def _type_fields(cls: type) -> list[str]:
    names: list[str] = []
    if hasattr(cls, "model_fields"):
        names += [n for n in cls.model_fields if not n.startswith("_")]
    if dataclasses.is_dataclass(cls):
        names += [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]
    for n, v in vars(cls).items():
        if not n.startswith("_") and isinstance(v, (property, __import__("functools").cached_property)):
            names.append(n)
    return list(dict.fromkeys(names))


def _our_type(name: str) -> type | None:
    return getattr(atypes, name, None) or getattr(asyncsess, name, None)


def _type_rows(anchor: str, spec: dict[str, Any]) -> Iterator[Row]:
    for tname, cls in spec["types"].items():
        ours = _our_type(tname)
        if ours is None:
            yield _row(anchor, "types", tname, "type", "—", MISSING)
            continue
        yield _row(anchor, "types", tname, "type", f"`asyncsess.{ours.__name__}`", SAME)
        for field in _type_fields(cls):
            ok = field in getattr(ours, "model_fields", {}) or hasattr(ours, field)
            yield _row(anchor, "types", f"{tname}.{field}", "field", f"`.{field}`" if ok else "—", SAME if ok else MISSING)


def _error_rows(anchor: str, spec: dict[str, Any]) -> Iterator[Row]:
    for name in spec["errors"]:
        mine = getattr(asyncsess.errors, name, None)
        ok = isinstance(mine, type) and issubclass(mine, asyncsess.errors.AsyncSessError)
        yield _row(anchor, "errors", name, "exception", f"`asyncsess.{mine.__name__}`" if ok else "—", SAME if ok else MISSING)
    for name in spec["functions"]:
        mine = getattr(asyncsess.errors, name, None)
        yield _row(anchor, "errors", name, "function", f"`asyncsess.{name}`" if mine else "—", SAME if mine else MISSING)


def rows() -> list[Row]:
    out: list[Row] = []
    for anchor, spec in _anchors().items():
        out += [*_client_rows(anchor, spec), *_future_rows(anchor, spec), *_type_rows(anchor, spec), *_error_rows(anchor, spec)]
    return out


# ------------------------------------------------------------------------------------ output

AREAS = ["ServiceClient", "TrainingClient", "SamplingClient", "RestClient", "futures", "types", "errors"]
CORE = ["ServiceClient", "TrainingClient", "SamplingClient", "futures", "types", "errors"]  # the >= 95 % target
LABEL = {"tinker": "Tinker", "sagemaker": "SageMaker"}


def summary(all_rows: list[Row]) -> dict[tuple[str, str], tuple[int, int]]:
    """(anchor, area) -> (rows, same)."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for r in all_rows:
        n, s = out.get((r.anchor, r.area), (0, 0))
        out[(r.anchor, r.area)] = (n + 1, s + (r.status == SAME))
    return out


def core_share(counts: dict[tuple[str, str], tuple[int, int]], anchor: str) -> tuple[int, int]:
    """(rows, same) over the areas of the >= 95 % target (every area but Tinker's session-less RestClient)."""
    n = sum(v[0] for (a, area), v in counts.items() if a == anchor and area in CORE)
    s = sum(v[1] for (a, area), v in counts.items() if a == anchor and area in CORE)
    return n, s


def render() -> str:
    anchors = _anchors()
    all_rows = rows()
    counts = summary(all_rows)
    lines = [
        "# Compatibility with the anchors' public surface",
        "",
        "GENERATED by `scripts/gen_compat.py` from `tinker=="
        + anchors["tinker"]["version"]
        + "` and `sagemaker-train=="
        + anchors["sagemaker"]["version"]
        + "` (module `sagemaker.train.training_session`) by reflection; do not edit by hand. `nox -s tinker` fails when it is stale.",
        "",
        "Every public method of the anchors' clients (and each of its parameters: name, kind, default), their futures,",
        "the public fields of their types and their error classes, mapped to asyncsess. A loop written for either anchor",
        "ports by changing its imports (`asyncsess` for async code, `asyncsess.sync` for blocking code) and the",
        "`ServiceClient` URL. Status: **same** (the name exists; a parameter is accepted under the anchor's name, with the",
        "same default, and, where the anchor passes it positionally, at the same position, where asyncsess may name it",
        "with an alias of the same meaning, e.g. Tinker's `data` for SageMaker's `batch`), **ignored** (accepted, with no",
        "effect, for the reason given), **differs** or **missing** (for the reason given), **refused** (the name exists and",
        "raises `UnsupportedError` naming it and the fix). `_async` twins that pass their arguments on are compared with the",
        "method they call. Rules a porting user should know follow the tables.",
        "",
        "## Summary",
        "",
        "| anchor | area | rows | same | % same |",
        "|---|---|---:|---:|---:|",
    ]
    for anchor in ("tinker", "sagemaker"):
        tot_n = tot_s = 0
        for area in AREAS:
            if (anchor, area) not in counts:
                continue
            n, s = counts[(anchor, area)]
            tot_n, tot_s = tot_n + n, tot_s + s
            lines.append(f"| {LABEL[anchor]} | {area} | {n} | {s} | {100 * s / n:.1f} |")
        lines.append(f"| **{LABEL[anchor]}** | **all** | **{tot_n}** | **{tot_s}** | **{100 * tot_s / tot_n:.1f}** |")
        n, s = core_share(counts, anchor)
        lines.append(f"| **{LABEL[anchor]}** | **clients, futures, types, errors** | **{n}** | **{s}** | **{100 * s / n:.1f}** |")
    lines.append("")
    for anchor in ("tinker", "sagemaker"):
        for area in AREAS:
            mine = [r for r in all_rows if r.anchor == anchor and r.area == area]
            if not mine:
                continue
            lines += [f"## {LABEL[anchor]}: {area}", "", "| member | anchor | asyncsess | status | reason |", "|---|---|---|---|---|"]
            for r in mine:
                lines.append(f"| `{r.member}` | {r.anchor_text} | {r.ours} | {r.status} | {r.reason.replace('|', '/')} |")
            lines.append("")
    lines += [(ROOT / "scripts" / "compat_notes.md").read_text().rstrip(), ""]
    return "\n".join(lines)


def main() -> int:
    text = render()
    if "--check" in sys.argv:
        if not TARGET.exists() or TARGET.read_text() != text:
            print(f"{TARGET.relative_to(ROOT)} is stale: run python scripts/gen_compat.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    counts = summary(rows())
    for anchor in ("tinker", "sagemaker"):
        n, s = core_share(counts, anchor)
        print(f"{anchor}: {s}/{n} same ({100 * s / n:.1f} %) over clients, futures, types, errors")
    print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
