"""A check of a sampled tool call's arguments against its tool's JSON schema, for ``strict`` tools.

The front samples the policy unconstrained (constrained decoding would train on a distribution the policy does not
have), so a strict tool's arguments may break its schema; :func:`schema_error` says where, and the capture keeps it
(``CapturedChoice.schema_errors``) for a reward to penalise. It checks the keywords OpenAI's strict mode takes:
``type``, ``enum``, ``const``, ``properties``, ``required``, ``additionalProperties``, ``items``, ``anyOf``,
``oneOf``, ``allOf``, local ``$ref`` (``#/$defs/...``), ``minimum`` / ``maximum`` (and exclusive), ``minLength`` /
``maxLength``, ``minItems`` / ``maxItems``; others are not checked: ``format``, and ``pattern`` (a client's regular
expression could backtrack for minutes on the server's event loop). The check runs on the event loop, so it has a
budget: a schema that needs more than ``MAX_STEPS`` steps (``anyOf`` over ``$ref`` cycles, say) is not checked.
"""

from __future__ import annotations

from typing import Any

__all__ = ["schema_error", "MAX_STEPS"]

_MAX_DEPTH = 256  # schema levels followed (a $ref cycle that consumes no value stops here)
MAX_STEPS = 100_000  # per call: a node visited, and each item of its enum / type / required lists; past it, not checked


class _OutOfSteps(Exception):
    pass


def schema_error(schema: dict[str, Any], value: Any) -> str | None:
    """The first way ``value`` breaks ``schema`` (``"arguments.city: expected string, got integer"``), else None
    (also when the schema needs more than ``MAX_STEPS`` steps to check)."""
    try:
        return _check(schema, value, "arguments", schema, 0, [MAX_STEPS])
    except _OutOfSteps:
        return None


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object" if isinstance(value, dict) else type(value).__name__


def _resolve(ref: str, root: dict[str, Any]) -> Any:
    if not ref.startswith("#"):
        return None  # a remote schema: not fetched, not checked
    node: Any = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _spend(steps: list[int], n: int) -> None:
    steps[0] -= n
    if steps[0] < 0:
        raise _OutOfSteps


def _check(schema: Any, value: Any, at: str, root: dict[str, Any], depth: int, steps: list[int]) -> str | None:
    _spend(steps, 1)
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return None if schema is not False else f"{at}: not allowed"
    # a keyword's list is scanned whole: its length is spent too (a 2,000-value enum behind anyOf of $refs, checked
    # 100,000 times, held the event loop for 90 s)
    _spend(steps, sum(len(v) for k in ("enum", "type", "required") if isinstance(v := schema.get(k), list)))
    if isinstance(schema.get("$ref"), str) and (err := _check(_resolve(schema["$ref"], root), value, at, root, depth + 1, steps)):
        return err
    kind = _type_of(value)
    types = schema.get("type")
    if types is not None:
        allowed = types if isinstance(types, list) else [types]
        if kind not in allowed and not (kind == "integer" and "number" in allowed):
            return f"{at}: expected {' or '.join(map(str, allowed))}, got {kind}"
    if "enum" in schema and isinstance(schema["enum"], list) and not any(_same(value, e) for e in schema["enum"]):
        return f"{at}: {_show(value)} is not one of {_show(schema['enum'])}"
    if "const" in schema and not _same(value, schema["const"]):
        return f"{at}: expected {_show(schema['const'])}"
    for sub in _list(schema.get("allOf")):
        if err := _check(sub, value, at, root, depth + 1, steps):
            return err
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            passed = sum(_check(sub, value, at, root, depth + 1, steps) is None for sub in options)
            if passed == 0 or (key == "oneOf" and passed > 1):
                return f"{at}: matches {passed} of the {key} schemas"
    if kind == "object":
        return _check_object(schema, value, at, root, depth, steps)
    if kind == "array":
        for i, item in enumerate(value):
            if err := _check(schema.get("items"), item, f"{at}.{i}", root, depth + 1, steps):
                return err
        return _bounds(len(value), schema, "minItems", "maxItems", at, "items")
    if kind == "string":
        return _bounds(len(value), schema, "minLength", "maxLength", at, "characters")
    if kind in ("integer", "number"):
        return _range(value, schema, at)
    return None


def _check_object(schema: dict[str, Any], value: dict[str, Any], at: str, root: dict[str, Any], depth: int, steps: list[int]) -> str | None:
    props = schema.get("properties")
    props = props if isinstance(props, dict) else {}
    for name in _list(schema.get("required")):
        if isinstance(name, str) and name not in value:
            return f"{at}: missing required property {_show(name)}"
    extra = schema.get("additionalProperties", True)
    for name, item in value.items():
        sub = props.get(name, extra)
        if sub is False:
            return f"{at}: unexpected property {_show(name)}"
        if err := _check(sub, item, f"{at}.{name}", root, depth + 1, steps):
            return err
    return None


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []  # a keyword of the wrong type is not checked


def _bounds(n: int, schema: dict[str, Any], low: str, high: str, at: str, what: str) -> str | None:
    if isinstance(schema.get(low), int) and n < schema[low]:
        return f"{at}: {n} {what}, at least {schema[low]}"
    if isinstance(schema.get(high), int) and n > schema[high]:
        return f"{at}: {n} {what}, at most {schema[high]}"
    return None


def _range(x: float, schema: dict[str, Any], at: str) -> str | None:
    checks = [("minimum", lambda b: x >= b), ("maximum", lambda b: x <= b)]
    checks += [("exclusiveMinimum", lambda b: x > b), ("exclusiveMaximum", lambda b: x < b)]
    for key, ok in checks:
        bound = schema.get(key)
        if isinstance(bound, (int, float)) and not isinstance(bound, bool) and not ok(bound):
            return f"{at}: {x} breaks {key} {bound}"
    return None


def _same(a: Any, b: Any) -> bool:
    """JSON equality: ``1 == True`` in Python, not in JSON."""
    return _type_of(a) == _type_of(b) and a == b if not isinstance(a, (list, dict)) else a == b


def _show(v: Any) -> str:
    """``v`` in at most 80 characters, without writing out all of a long list (an error string is made on every
    failed ``anyOf`` branch)."""
    if isinstance(v, list) and len(v) > 8:
        return (repr(v[:8])[:-1] + ", ...]")[:80]
    return repr(v)[:80]
