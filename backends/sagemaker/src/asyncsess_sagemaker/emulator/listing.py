"""The List* operations' common rules: which request members the emulator applies, filters and sort, and pages.

Every member of a List* input in the service model is either applied here or refused by :func:`check_applied` with a
``ValidationException`` naming it (a member botocore adds later is refused until it is applied): a filter that was
ignored answered rows it should have left out.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from ..shape_check import epoch_seconds
from .errors import AwsError

__all__ = ["APPLIED", "NOT_APPLIED", "check_applied", "filtered", "page", "schema_version"]

_PAGING = frozenset({"NextToken", "MaxResults"})
_WINDOW = frozenset({"NameContains", "CreationTimeAfter", "CreationTimeBefore", "SortBy", "SortOrder"})

# per List* operation: the request members the emulator applies
APPLIED: dict[str, frozenset[str]] = {
    "ListTrainingSessions": _PAGING | _WINDOW - {"SortBy", "SortOrder"} | {"StatusEquals"},
    "ListModelPackages": _PAGING | _WINDOW | {"ModelPackageGroupName", "ModelPackageType"},
    "ListModelPackageGroups": _PAGING | _WINDOW | {"CrossAccountFilterOption"},
    "ListHubContents": _PAGING | _WINDOW | {"HubName", "HubContentType", "MaxSchemaVersion"},
    "ListTags": _PAGING | {"ResourceArn"},
}
# why a member the model has is not applied (and so refused)
NOT_APPLIED = {
    "ModelApprovalStatus": "the emulator keeps no approval status on model packages (training sessions register them), "
    "so it cannot filter by one: leave ModelApprovalStatus out",
}


def check_applied(op_name: str, body: dict[str, Any]) -> None:
    """Refuse a member of a List* request that the emulator would not apply (a ValidationException naming it)."""
    applied = APPLIED.get(op_name)
    if applied is None:
        return
    for member in sorted(set(body) - applied):
        if body[member] is not None:
            why = NOT_APPLIED.get(member, f"the emulator does not apply {member}: leave it out")
            raise AwsError.validation(f"Value {json.dumps(body[member])[:64]} at '{member}' is not supported: {why}")


def filtered(rows: list[dict[str, Any]], body: dict[str, Any], name_key: str, sort_keys: dict[str, str]) -> list[dict[str, Any]]:
    """The rows NameContains, CreationTimeAfter and CreationTimeBefore keep, sorted by the row key ``sort_keys`` maps
    SortBy to (default ``CreationTime``; ties keep their order, a package's version breaks them) in SortOrder
    (default ``Ascending``), as the model registry's and the hub's List operations document."""
    name, after, before = body.get("NameContains"), body.get("CreationTimeAfter"), body.get("CreationTimeBefore")
    kept = [
        r
        for r in rows
        if (not name or name in r[name_key])
        and (after is None or r["CreationTime"] > epoch_seconds(after))
        and (before is None or r["CreationTime"] < epoch_seconds(before))
    ]
    key = sort_keys[body.get("SortBy") or "CreationTime"]
    kept.sort(key=lambda r: (r[key], r.get("ModelPackageVersion", 0)))
    if body.get("SortOrder") == "Descending":
        kept.reverse()
    return kept


def schema_version(text: str) -> tuple[int, ...]:
    """A hub document schema version (``2.4.0``: the model's pattern, whose ``.`` takes any character but a line
    terminator) as numbers to compare; ``()`` for text that does not match it."""
    m = re.fullmatch(r"(\d{1,4})[^\n\r\x85\u2028\u2029](\d{1,4})[^\n\r\x85\u2028\u2029](\d{1,4})", text)
    return tuple(int(part) for part in m.groups()) if m else ()


def page(rows: list[dict[str, Any]], body: dict[str, Any], key: str, caller: str) -> dict[str, Any]:
    """One page of a List* answer. ``NextToken`` names the list (``key``), a digest of the caller's account and the
    request's filters and sort order (every member but ``NextToken`` and ``MaxResults``), and the offset of the next
    row, as an earlier page of this operation with these filters returned it to this account; any other token is a
    ValidationException, as AWS answers ("abc" was a 500, "-1" a slice from the end, a token of another List operation
    was read as an offset into this one, and one issued for other filters paged through rows it never counted)."""
    filters = _filters_digest(body, caller)
    token = body.get("NextToken") or f"{key}:{filters}:0"
    listed, given, offset = token.split(":", 2) if isinstance(token, str) and token.count(":") == 2 else ("", "", "")
    if listed != key or not (offset.isascii() and offset.isdigit() and len(offset) < 19):
        raise AwsError.validation(
            f"NextToken {json.dumps(token)[:64]} is not a pagination token this operation returned: pass NextToken back unchanged"
        )
    if given != filters:
        raise AwsError.validation(
            f"NextToken {json.dumps(token)[:64]} was returned for other request parameters or to another account: "
            "repeat the filters and sort order of the call that returned it, or start again without NextToken"
        )
    start = int(offset)
    size = body.get("MaxResults") or 100
    out: dict[str, Any] = {key: rows[start : start + size]}
    if start + size < len(rows):
        out["NextToken"] = f"{key}:{filters}:{start + size}"
    return out


def _filters_digest(body: dict[str, Any], caller: str) -> str:
    """A short digest of the caller's account and a List* request's members other than ``NextToken`` and
    ``MaxResults`` (a page size may change)."""
    kept = {k: v for k, v in body.items() if k not in _PAGING and v is not None}
    return hashlib.sha256(json.dumps([caller, kept], sort_keys=True, default=str).encode()).hexdigest()[:16]
