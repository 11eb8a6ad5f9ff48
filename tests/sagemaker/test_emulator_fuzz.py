"""Hostile input on the emulator, generated from botocore's own service models.

For every operation the emulator serves and every member of its input (nested ones included), the test sends
each constraint's boundary and one past it (length, value, enum, pattern), wrong JSON types, NUL, a lone
surrogate, a 100k-character string and odd timestamps, raw over HTTP (boto3 would refuse most of them first).
A value that breaks a constraint must be a ValidationException naming the member; a value inside the constraints
must not be refused for its shape; nothing may be a 5xx or hang, and a refusal changes nothing the List and
Describe operations show. Expectations come from the model and an oracle written here, not from the emulator.
The runtime's JSON operations get the same edge values (each kind of operation in turn) and the same verdicts, less
the state check: a refused training op uses up its sequence number by design.
"""

from __future__ import annotations

import copy
import json
import math
import re
import sys
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from botocore.exceptions import ClientError
from botocore.model import Shape

from asyncsess_sagemaker.emulator import EmulatorConfig, RunningEmulator, running_emulator
from asyncsess_sagemaker.emulator.app import CONTROL_OPERATIONS
from asyncsess_sagemaker.service_models import CONTROL, RUNTIME, control_model, operation, runtime_model
from asyncsess_sagemaker.shape_check import _regex, java_regex

from .helpers import ROLE, SIGNED, ce_datum, clients, hub_arn, new_session, wait_op

pytestmark = pytest.mark.sagemaker

SESSION, GROUP = "fuzz-session", "fuzz-group"  # lengths no limit of the model has: an edge value never names them

# A value inside its shape's constraints for every patterned string shape the served operations take (the base of
# each edge value). A shape the model gains later fails test_every_patterned_string_has_a_sample until it has one.
SAMPLES = {
    "TrainingSessionName": "fuzz-x",
    "ModelPackageGroupArn": "arn:aws:sagemaker:us-west-2:111122223333:model-package-group/no-such-group",
    "RoleArn": ROLE,
    "SecurityGroupId": "sg-0123456789",
    "SubnetId": "subnet-0123456789",
    "BaseModelArn": "arn:aws:sagemaker:us-west-2:aws:hub-content/SageMakerPublicHub/Model/no-such-model/1.0.0",
    "OutputS3Path": "s3://bucket/out",
    "CustomerKmsKeyArn": "arn:aws:kms:us-west-2:111122223333:key/0123abcd-0123-abcd-0123-0123456789ab",
    "TagKey": "team",
    "TagValue": "ml",
    "NextToken": "",
    "NameContains": "fuzz",
    "EntityName": "fuzz-new-group",
    "EntityDescription": "A description, with punctuation & symbols: 42 é",
    "ArnOrName": GROUP,
    "VersionedArnOrName": "arn:aws:sagemaker:us-west-2:111122223333:model-package/fuzz-group/1",
    "HubNameOrArn": "SageMakerPublicHub",
    "HubContentName": "no-such-model",
    "DocumentSchemaVersion": "2.4.0",
    "HubContentVersion": "1.0.0",
    "ClientToken": "token-1",  # the runtime's
    "ResourceArn": f"arn:aws:sagemaker:us-west-2:111122223333:training-session/{SESSION}",
}
SESSION_ARN = SAMPLES["ResourceArn"]


# A runtime string the service stores as a control-plane member is held to that member's constraints too: a save's
# description becomes the model package's ModelPackageDescription (EntityDescription).
STORED_AS = {"SaveStateConfigDescriptionString": "EntityDescription", "SaveWeightsConfigDescriptionString": "EntityDescription"}

# ------------------------------------------------------------------------------------------------- the oracle


def _category_class_matches(pattern: str, value: str) -> bool | None:
    """``[\\p{L}...x-y]*`` patterns (optionally in a group) read with :mod:`unicodedata`; None for other patterns."""
    m = re.fullmatch(r"\(?\[(.*)\]\*\)?", pattern)
    if m is None or "\\p{" not in pattern:
        return None
    categories, literals = set(), set()
    for cat, escaped, plain in re.findall(r"\\p\{(\w+)\}|\\(.)|(.)", m[1]):
        if cat:
            categories.add(cat)
        else:
            literals.add(escaped or plain)
    return all(c in literals or unicodedata.category(c)[0] in categories for c in value)


def _pattern_matches(pattern: str, value: str) -> bool:
    """As Java reads the model's patterns: ``\\d``, ``\\w``, ``\\s`` are ASCII (re.ASCII); the ``\\p{..}`` classes by
    their Unicode general category."""
    by_category = _category_class_matches(pattern, value)
    if by_category is not None:
        return by_category
    assert "\\p" not in pattern, f"the oracle does not read {pattern}"
    return re.fullmatch(pattern, value, re.ASCII) is not None


def _string_ok(shape: Shape, value: str) -> bool:
    lo, hi = shape.metadata.get("min", 0), shape.metadata.get("max", 10**9)
    if shape.enum:  # type: ignore[attr-defined]
        return value in shape.enum  # type: ignore[attr-defined]
    pattern = shape.metadata.get("pattern")
    return lo <= len(value) <= hi and (pattern is None or _pattern_matches(pattern, value))


def _number_ok(shape: Shape, value: int) -> bool:
    bits = 31 if shape.type_name == "integer" else 63
    lo, hi = shape.metadata.get("min", -(2**bits)), shape.metadata.get("max", 2**bits - 1)
    return max(lo, -(2**bits)) <= value <= min(hi, 2**bits - 1)


def sample(shape: Shape) -> Any:
    """A value inside ``shape``'s constraints (required members only)."""
    kind = shape.type_name
    if kind == "structure":
        return {name: sample(shape.members[name]) for name in shape.required_members}  # type: ignore[attr-defined]
    if kind == "list":
        return [sample(shape.member)] * max(shape.metadata.get("min", 0), 1)  # type: ignore[attr-defined]
    if kind == "string":
        return shape.enum[0] if shape.enum else SAMPLES[shape.name] if shape.metadata.get("pattern") else "x"  # type: ignore[attr-defined]
    if kind in ("integer", "long"):
        return max(shape.metadata.get("min", 1), 1)
    if kind in ("double", "float"):
        return shape.metadata.get("max", 0.5)
    return {"boolean": True, "timestamp": 1_700_000_000, "map": {}}[kind]


# ---------------------------------------------------------------------------------------------- edge values

TAKEN, REFUSED, ANY = "taken", "refused", "any"  # not refused for its shape / ValidationException naming it / no 5xx
WRONG_TYPES = {
    "string": [5, True, [], {}],
    "integer": ["1", 1.5, True, [], {}],
    "boolean": ["true", 1, 0, [], {}],
    "timestamp": [True, [], {}, "", "not-a-date", "2024-13-01T00:00:00Z"],
    "structure": ["x", 5, []],
    "list": ["x", 5, {}],
    "map": ["x", 5, []],
    "double": ["1", True, [], {}],
}
WRONG_TYPES["long"] = WRONG_TYPES["integer"]
WRONG_TYPES["float"] = WRONG_TYPES["double"]


def _fit(current: str, n: int, shape: Shape) -> str:
    """A string of length ``n`` from ``current``: inside the pattern where a simple padding or cut gets there."""
    candidates = [current[:n]] + [current + c * (n - len(current)) for c in "a0-"] + [c * n for c in "a0"]
    candidates += [current[: n - 1] + c for c in "a0"] if n else []
    fitting = [c for c in candidates if len(c) == n]
    return next((c for c in fitting if _string_ok(shape, c)), fitting[0])


def _string_edges(shape: Shape, current: str) -> Iterator[tuple[Any, str]]:
    if shape.enum:  # type: ignore[attr-defined]
        yield from ((v, TAKEN) for v in shape.enum)  # type: ignore[attr-defined]
        odd = ("Bogus", shape.enum[0].lower(), shape.enum[0].upper(), shape.enum[0] + " ", "")  # type: ignore[attr-defined]
        yield from ((v, REFUSED) for v in odd if v not in shape.enum)  # type: ignore[attr-defined]
        return
    lo, hi = shape.metadata.get("min", 0), shape.metadata.get("max")
    lengths = {lo, lo - 1} | ({hi, hi + 1} if hi is not None else set())
    values = [_fit(current, n, shape) for n in sorted(lengths) if n >= 0]
    values += ["", "\x00", current + "\x00", "\ud800", current + "\udfff", "a" * 100_000, " " + current, current + "\n", "é"]
    values += [current.translate(str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩"))]  # digits Java's \d does not take
    values += [current.replace("-", "\u2028"), current + "\U0001d400"]  # a line separator; an astral letter
    stored = STORED_AS.get(shape.name)
    for v in dict.fromkeys(values):
        ok = _string_ok(shape, v) and (stored is None or _string_ok(control_model().shape_for(stored), v))
        yield v, TAKEN if ok else REFUSED


def edges(shape: Shape, current: Any, required: bool) -> Iterator[tuple[Any, str]]:
    """(value, expectation) for one member whose shape is ``shape`` and whose valid value is ``current``."""
    kind = shape.type_name
    yield None, REFUSED if required else TAKEN
    if shape.metadata.get("document"):  # any JSON value
        return
    yield from ((v, REFUSED) for v in WRONG_TYPES[kind])
    if kind == "string":
        yield from _string_edges(shape, current)
    elif kind in ("integer", "long"):
        lo, hi = shape.metadata.get("min"), shape.metadata.get("max")
        values = {0, -1, 1, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 10**400}
        values |= {b + d for b in (lo, hi) if b is not None for d in (-1, 0, 1)}
        yield from ((v, TAKEN if _number_ok(shape, v) else REFUSED) for v in sorted(values))
        yield 1.0, ANY  # a JSON number with a fraction part of zero
    elif kind in ("double", "float"):
        lo, hi = shape.metadata.get("min"), shape.metadata.get("max")
        yield from ((v, REFUSED) for v in (float("nan"), float("inf"), float("-inf"), 10**400))
        values = {0, -0.0, 5e-324, -5e-324, 1e308, -1e308, 1}
        values |= {v for b in (lo, hi) if b is not None for v in (b, math.nextafter(b, -math.inf), math.nextafter(b, math.inf))}
        yield from ((v, TAKEN if (lo is None or v >= lo) and (hi is None or v <= hi) else REFUSED) for v in sorted(values))
    elif kind == "map":
        yield {}, TAKEN if shape.metadata.get("min", 0) == 0 else REFUSED
    elif kind == "boolean":
        yield from ((v, TAKEN) for v in (True, False))
    elif kind == "timestamp":
        yield from ((v, TAKEN) for v in (0, -0.0, 5e-324, 1_700_000_000.5, "2024-01-01T00:00:00Z", "2024-01-01", "0001-01-01T00:00:00"))
        yield from ((v, REFUSED) for v in (float("nan"), float("inf"), float("-inf"), 10**400))  # 10**400: past the floats
        yield from ((v, ANY) for v in (2**63, -(2**63) - 1, 1e308, "9999-12-31T23:59:59-23:59"))
    elif kind == "structure" and shape.metadata.get("union"):  # exactly one member
        yield {}, REFUSED
        other = next(name for name in shape.members if name not in current)  # type: ignore[attr-defined]
        yield {**current, other: {}}, REFUSED
    elif kind == "structure":
        yield {}, REFUSED if shape.required_members else TAKEN  # type: ignore[attr-defined]
        yield {**current, "NotAMember": 1}, ANY
    elif kind == "list":
        lo, hi = shape.metadata.get("min", 0), shape.metadata.get("max")
        item = sample(shape.member)  # type: ignore[attr-defined]
        yield [], TAKEN if lo == 0 else REFUSED
        yield [None], REFUSED
        if hi is not None:
            yield [copy.deepcopy(item) for _ in range(hi)], TAKEN
            yield [copy.deepcopy(item) for _ in range(hi + 1)], REFUSED
    else:
        raise AssertionError(f"no edge values for {kind} (a new kind of member in the model?)")


@dataclass(frozen=True)
class Case:
    path: str  # the member as a ValidationException names it: LoraConfig.Rank, Tags[0].Key
    body: dict[str, Any]
    expect: str
    value: Any

    def __str__(self) -> str:
        return f"{self.path} = {json.dumps(self.value)[:80]} (expected {self.expect})"


def _members(shape: Shape, value: dict[str, Any], path: str) -> Iterator[tuple[str, list[Any], Shape, Any, bool]]:
    """(path, keys, member shape, current value, required) of every member under ``shape``, depth first (of a union,
    the member ``value`` sets)."""
    for name, member in shape.members.items():  # type: ignore[attr-defined]
        if shape.metadata.get("union") and name not in value:
            continue
        current = value.get(name)
        if current is None:
            current = sample(member)
        where = f"{path}.{name}" if path else name
        yield where, [name], member, current, name in shape.required_members  # type: ignore[attr-defined]
        inner, keys, at = member, [name], where
        if member.type_name == "list" and member.member.type_name == "structure":  # type: ignore[attr-defined]
            inner, current, keys, at = member.member, current[0], [name, 0], f"{where}[0]"  # type: ignore[attr-defined]
        if inner.type_name == "structure" and not inner.metadata.get("document"):
            for sub, subkeys, sub_shape, sub_current, req in _members(inner, current, at):
                yield sub, keys + subkeys, sub_shape, sub_current, req


def _set(body: dict[str, Any], keys: list[Any], value: Any, shape: Shape) -> dict[str, Any]:
    """``body`` with the member at ``keys`` set to ``value`` (parents filled with samples; None: left out)."""
    out = copy.deepcopy(body)
    node, node_shape = out, shape
    for key in keys[:-1]:
        if isinstance(key, int):
            node_shape = node_shape.member  # type: ignore[attr-defined]
        else:
            node_shape = node_shape.members[key]  # type: ignore[attr-defined]
            if node.get(key) is None:
                node[key] = sample(node_shape)
        node = node[key]
    if value is None:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return out


def cases(op_name: str, base: dict[str, Any], service: str = CONTROL) -> list[Case]:
    """Every edge value of every member; a Create names a new resource in each case (else all but the first taken
    one would be refused as a duplicate, hiding whether the value itself is taken)."""
    shape = operation(service, op_name).input_shape
    out = [Case("", base, TAKEN, None), Case("NotAMember", base | {"NotAMember": 1}, ANY, 1)]
    for path, keys, member, current, required in _members(shape, base, ""):
        for value, expect in edges(member, current, required):
            body = _set(base, keys, value, shape)
            name = next(iter(base), "")
            if op_name.startswith("Create") and path != name:
                body[name] = f"{base[name]}-{len(out)}"
            out.append(Case(path, body, expect, value))
    return out


# -------------------------------------------------------------------------------------------- the emulator


@dataclass
class World:
    emu: RunningEmulator
    package: str
    model: str


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    """An emulator (strict answers) with one Running session that saved one package into one group."""
    with running_emulator(
        "mock://", EmulatorConfig(check_responses=True, startup_s=0.0, stop_s=0.0, sample_max_tokens=2, gap_timeout_s=3600.0)
    ) as emu:
        sm, rt = clients(emu.url)
        group_arn = sm.create_model_package_group(ModelPackageGroupName=GROUP)["ModelPackageGroupArn"]
        sm.create_training_session(
            TrainingSessionName=SESSION,
            ModelPackageGroupArn=group_arn,
            LoraConfig={"Rank": 8, "Alpha": 16},
            RoleArn=ROLE,
            ModelConfig={"BaseModelArn": hub_arn(sm)},
            OutputConfig={"S3Location": {"Path": "s3://bucket/out"}},
        )
        op = rt.execute_training_operation(trainingSessionName=SESSION, sequenceNumber=1, operationConfig={"saveState": {}})
        package = wait_op(rt.get_training_operation_result, SESSION, op["operationId"])["operationResult"]["saveState"]["modelPackageArn"]
        yield World(emu, package, hub_arn(sm))


def _bases(world: World) -> dict[str, dict[str, Any]]:
    """A request each served operation takes, naming the world's resources (creates name new ones)."""
    create = {
        "TrainingSessionName": "fuzz-new-session",
        "LoraConfig": {"Rank": 8, "Alpha": 16},
        "RoleArn": ROLE,
        "ModelConfig": {"BaseModelArn": world.model},
        "OutputConfig": {"S3Location": {"Path": "s3://bucket/out"}},
    }
    hub = {"HubName": "SageMakerPublicHub", "HubContentType": "Model"}
    return {
        "CreateTrainingSession": create,
        "DescribeTrainingSession": {"TrainingSessionName": SESSION},
        "ListTrainingSessions": {},
        "StopTrainingSession": {"TrainingSessionName": "fuzz-no-such-session"},
        "DeleteTrainingSession": {"TrainingSessionName": "fuzz-no-such-session"},
        "CreateModelPackageGroup": {"ModelPackageGroupName": "fuzz-new-group"},
        "DescribeModelPackageGroup": {"ModelPackageGroupName": GROUP},
        "DeleteModelPackageGroup": {"ModelPackageGroupName": "fuzz-no-such-group"},
        "ListModelPackageGroups": {},
        "DescribeModelPackage": {"ModelPackageName": world.package},
        "ListModelPackages": {"ModelPackageGroupName": GROUP},
        "DeleteModelPackage": {"ModelPackageName": world.package.replace("/1", "/99")},
        "ListHubContents": hub,
        "DescribeHubContent": hub | {"HubContentName": world.model.split("/")[-2]},
        "AddTags": {"ResourceArn": SESSION_ARN, "Tags": [{"Key": "team", "Value": "ml"}]},
        "ListTags": {"ResourceArn": SESSION_ARN},
        "DeleteTags": {"ResourceArn": SESSION_ARN, "TagKeys": ["team"]},
    }


def _call(client: httpx.Client, op_name: str, body: dict[str, Any]) -> httpx.Response:
    return client.post(
        "/", content=json.dumps(body), headers={"X-Amz-Target": f"SageMaker.{op_name}", "Content-Type": "application/x-amz-json-1.1"}
    )


def _state(client: httpx.Client) -> list[Any]:
    """What the List and Describe operations show (strict: each answer is checked against the model)."""
    reads = [
        ("ListTrainingSessions", {"MaxResults": 100}),
        ("ListModelPackageGroups", {"MaxResults": 100}),
        ("ListModelPackages", {"MaxResults": 100, "ModelPackageType": "Both"}),
        ("DescribeTrainingSession", {"TrainingSessionName": SESSION}),
    ]
    answers = [_call(client, op, body) for op, body in reads]
    assert [a.status_code for a in answers] == [200] * len(reads), [a.text[:300] for a in answers if a.status_code != 200]
    return [a.json() for a in answers]


def _is_shape_refusal(response: httpx.Response) -> bool:
    return response.status_code == 400 and "failed to satisfy constraint" in response.json().get("Message", "")


@pytest.mark.parametrize("op_name", CONTROL_OPERATIONS)
def test_edge_values_of_every_member_are_refused_naming_it_or_taken(world, op_name):
    failures = []
    with httpx.Client(base_url=world.emu.url, timeout=30.0, auth=SIGNED) as client:
        before = _state(client)
        for case in cases(op_name, _bases(world)[op_name]):
            response = _call(client, op_name, case.body)
            answer = response.json()
            if response.status_code >= 500:
                failures.append(f"{case}: {response.status_code} {answer}")
            elif case.expect == REFUSED and not (
                response.status_code == 400
                and answer.get("__type") == "ValidationException"
                and f"'{case.path}" in answer["Message"]  # the member or one inside it
            ):
                failures.append(f"{case}: answered {response.status_code} {str(answer)[:200]}")
            elif case.expect == TAKEN and _is_shape_refusal(response):
                failures.append(f"{case}: refused for its shape: {answer['Message'][:200]}")
            if response.status_code == 200:
                before = _state(client)
                if op_name.startswith("Create"):  # what was taken describes (strict: as the model says)
                    described = _call(client, op_name.replace("Create", "Describe"), {k: case.body[k] for k in list(case.body)[:1]})
                    if described.status_code != 200:
                        failures.append(f"{case}: created, then Describe answered {described.status_code} {described.text[:200]}")
            elif (after := _state(client)) != before:
                failures.append(f"{case}: refused ({answer.get('__type')}) but the state changed")
                before = after
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])


def test_every_patterned_string_has_a_sample():
    """The samples are inside their shapes' constraints (by the oracle), and every patterned string shape of the served
    operations has one."""
    seen: set[str] = set()

    def walk(shape: Shape) -> None:
        if shape.name in seen:
            return
        seen.add(shape.name)
        if shape.type_name == "structure":
            for member in shape.members.values():  # type: ignore[attr-defined]
                walk(member)
        elif shape.type_name == "list":
            walk(shape.member)  # type: ignore[attr-defined]
        elif shape.type_name == "string" and shape.metadata.get("pattern"):
            assert shape.name in SAMPLES, f"SAMPLES needs a value for {shape.name}"
            assert _string_ok(shape, SAMPLES[shape.name]), shape.name

    for op_name in CONTROL_OPERATIONS:
        walk(operation(CONTROL, op_name).input_shape)


# ------------------------------------------------------------------------------------ the Java patterns


def test_every_pattern_of_the_served_inputs_is_checked():
    """The \\p{..} patterns (tag keys and values, descriptions) were not compiled by ``re``, so nothing checked them."""
    patterns = set()
    for op_name in CONTROL_OPERATIONS:
        patterns |= _patterns(operation(CONTROL, op_name).input_shape, set())
    for name in runtime_model().operation_names:
        patterns |= _patterns(runtime_model().operation_model(name).input_shape, set())
    assert any("\\p{" in p for p in patterns)
    assert [p for p in patterns if _regex(p) is None] == []


def _patterns(shape: Shape, seen: set[str]) -> set[str]:
    if shape.name in seen:
        return set()
    seen.add(shape.name)
    inner = {"structure": lambda: list(shape.members.values()), "list": lambda: [shape.member]}.get(shape.type_name, list)  # type: ignore[attr-defined]
    found = {shape.metadata["pattern"]} if shape.metadata.get("pattern") else set()
    for member in inner():
        found |= _patterns(member, seen)
    return found


def test_a_unicode_category_class_takes_exactly_its_code_points():
    """Each category the models' patterns use (and one subcategory), against :mod:`unicodedata`, over all of Unicode."""
    every = "".join(map(chr, range(sys.maxunicode + 1)))
    categories = [unicodedata.category(c) for c in every]
    for category in ("L", "M", "Z", "S", "N", "P", "Nd"):
        taken = set(re.findall(java_regex(f"[\\p{{{category}}}]"), every, re.ASCII))
        assert taken == {c for c, cat in zip(every, categories) if cat.startswith(category)}, category
        assert len(re.findall(java_regex(f"\\P{{{category}}}"), every, re.ASCII)) == len(every) - len(taken), category


@pytest.mark.parametrize(
    ("pattern", "value", "matches"),
    [
        ("([\\p{L}\\p{Z}\\p{N}_.:/=+\\-@]*)", "Team Name_1:é/日本=+-@", True),
        ("([\\p{L}\\p{Z}\\p{N}_.:/=+\\-@]*)", "a\x00", False),
        ("([\\p{L}\\p{Z}\\p{N}_.:/=+\\-@]*)", "\ud800", False),
        ("([\\p{L}\\p{Z}\\p{N}_.:/=+\\-@]*)", "a!", False),
        ("([\\p{L}\\p{Z}\\p{N}_.:/=+\\-@]*)", "\U0001d400", True),  # an astral letter: one code point, as in Java
        ("[\\p{L}\\p{M}\\p{Z}\\p{S}\\p{N}\\p{P}]*", "Fine-tuned on 10% of the data (v2) — OK? ✓", True),
        ("[\\p{L}\\p{M}\\p{Z}\\p{S}\\p{N}\\p{P}]*", "two\nlines", False),
        ("[\\p{L}\\p{M}\\p{Z}\\p{S}\\p{N}\\p{P}]*", "tab\there", False),
        ("arn:[\\p{Alnum}\\-]+:lambda", "arn:aws-cn:lambda", True),
        ("arn:[\\p{Alnum}\\-]+:lambda", "arn:awsé:lambda", False),
        ("arn:aws[a-z\\-]*:iam::\\d{12}:role/?[a-zA-Z_0-9+=,.@\\-_/]+", "arn:aws:iam::111122223333:role/r", True),
        ("arn:aws[a-z\\-]*:iam::\\d{12}:role/?[a-zA-Z_0-9+=,.@\\-_/]+", "arn:aws:iam::١١١١٢٢٢٢٣٣٣٣:role/r", False),  # Java's \d
        (".*", "a\rb", False),  # Java's '.' stops at \r, \u0085, \u2028, \u2029 too
        (".*", "a\u2028b", False),
        (".*", "a.b\x00", True),
        ("[.]", ".", True),  # a dot in a class stays a dot
        ("[.]", "a", False),
        ("\\.", "a", False),
    ],
)
def test_java_patterns_read_as_java_reads_them(pattern, value, matches):
    rx = _regex(pattern)
    assert rx is not None and (rx.fullmatch(value) is not None) == matches


# ---------------------------------------------------------------------------------------------------- runtime

RUNTIME_OPS = ("ExecuteTrainingOperation", "ExecuteSamplingOperation", "GetTrainingOperationResult", "GetSamplingOperationResult")
# the model's own constraints, as shape_check words them (the service's prose rules are worded otherwise)
_MODEL_CONSTRAINT = re.compile(
    r"Member must (have (length|value)|satisfy|not be null|set exactly one|be an? (string|object|list|map|integer|number|finite number"
    r"|boolean|blob|timestamp)\b|be a (32|64)-bit integer)|Member is not part of"
)
PROMPT = {"chunks": [{"tokens": [1, 40], "type": "encoded_text"}]}


def _branches(package: str) -> dict[str, dict[str, Any]]:
    """A body each union member (operation kind) takes."""
    datums = {"lossFnName": "cross_entropy", "datumList": [ce_datum([1, 40, 41])]}
    return {
        "forward": datums,
        "forwardBackward": datums,
        "optimizerStep": {"adamParamsConfig": {"learningRate": 0.001}},
        "saveWeights": {"description": "w"},
        "saveState": {"description": "s"},
        "loadState": {"modelPackageArn": package, "loadOptimizer": True},
        "sample": {"prompt": PROMPT, "numSamples": 1, "samplingParams": {"maxTokens": 512}},
        "computeLogprobs": {"prompt": PROMPT},
        "loadWeightsForSampling": {"modelPackageArn": package},
    }


def _runtime_cases(op_name: str, session: str, op_ids: dict[str, str], package: str) -> list[Case]:
    union = {"ExecuteTrainingOperation": "OperationConfig", "ExecuteSamplingOperation": "SampleOperationConfig"}.get(op_name)
    if union is None:
        kind = "training" if "Training" in op_name else "sampling"
        return cases(op_name, {"trainingSessionName": session, "operationId": op_ids[kind]}, RUNTIME)
    base = {"trainingSessionName": session, "sequenceNumber": 1} if "Training" in op_name else {"trainingSessionName": session}
    members = runtime_model().shape_for(union).members  # type: ignore[attr-defined]
    out = []
    for kind in members:
        out += cases(op_name, base | {"operationConfig": {kind: _branches(package)[kind]}}, RUNTIME)
    return out


def _runtime_call(client: httpx.Client, op_name: str, body: dict[str, Any]) -> httpx.Response | None:
    """The request on its route (path members in the URI; None: a value no URI can carry)."""
    model = runtime_model().operation_model(op_name)
    uri, rest = model.http["requestUri"], dict(body)
    for name, member in model.input_shape.members.items():
        if member.serialization.get("location") == "uri":
            value = rest.pop(name, None)
            if not isinstance(value, str) or value in ("", ".", "..") or "/" in value or len(value) > 2000:
                return None
            try:
                uri = uri.replace("{" + name + "}", quote(value, safe=""))
            except UnicodeEncodeError:  # a lone surrogate
                return None
    if model.http["method"] == "GET":
        return client.get(uri) if not rest else None
    return client.post(uri, content=json.dumps(rest), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("op_name", RUNTIME_OPS)
def test_runtime_edge_values_of_every_member_are_refused_naming_it_or_taken(world, op_name):
    """As the control-plane test, on the runtime's JSON operations (the chat's are a payload; tested on their own)."""
    failures, taken = [], []
    sm, rt = clients(world.emu.url)
    with httpx.Client(base_url=world.emu.url, timeout=30.0, auth=SIGNED) as client:
        session, seq = _runtime_session(sm, op_name), 1
        op_ids = _runtime_ops(rt, session)
        for case in _runtime_cases(op_name, session, op_ids, world.package):
            body = dict(case.body)
            numbered = "sequenceNumber" in body and case.path not in ("sequenceNumber", "trainingSessionName")
            if numbered:  # the session's next number (one that goes elsewhere or nowhere would leave a gap)
                body["sequenceNumber"] = seq + 1
            response = _runtime_call(client, op_name, body)
            if response is None:
                continue
            seq += numbered
            kind = response.headers.get("x-amzn-errortype", "").partition(":")[0]
            message = response.json().get("message", "") if response.status_code != 200 else ""
            if response.status_code >= 500:
                failures.append(f"{case}: {response.status_code} {response.text[:200]}")
            elif case.expect == REFUSED and not (
                response.status_code == 400 and kind == "ValidationException" and f"'{case.path}" in message
            ):
                failures.append(f"{case}: answered {response.status_code} {kind} {message[:200]}")
            elif case.expect == TAKEN and f"'{case.path}'" in message and _MODEL_CONSTRAINT.search(message):
                failures.append(f"{case}: refused for its shape: {message[:200]}")
            if response.status_code == 200 and op_name.startswith("Execute") and case.path != "sequenceNumber":
                taken.append((case, response.json()["operationId"]))
        get = rt.get_training_operation_result if "Training" in op_name else rt.get_sampling_operation_result
        for case, op_id in taken:  # each taken op's result answers (strict: as the model says)
            try:
                wait_op(get, session, op_id)
            except ClientError as err:
                failures.append(f"{case}: taken, then its result was {err.response['Error']}")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])


def _runtime_session(sm: Any, op_name: str) -> str:
    name = f"fuzz-rt-{RUNTIME_OPS.index(op_name)}"
    new_session(sm, name)
    return name


def _runtime_ops(rt: Any, session: str) -> dict[str, str]:
    """One training and one sampling operation of ``session``, for the Get*OperationResult bases."""
    training = rt.execute_training_operation(trainingSessionName=session, sequenceNumber=1, operationConfig={"saveState": {}})
    sampling = rt.execute_sampling_operation(trainingSessionName=session, operationConfig={"computeLogprobs": {"prompt": PROMPT}})
    return {"training": training["operationId"], "sampling": sampling["operationId"]}
