"""Hostile data-plane input through ``asyncsess.ServiceClient("sagemaker://...")`` against the emulator.

Names and descriptions with a NUL, a lone surrogate or 5000 characters, ARNs of another account, region or
partition (or a group where a version is asked for), non-finite, subnormal and huge Adam parameters: each is a typed
``InvalidInputError`` naming the field, raised before anything is sent. Nothing reaches the service: no session is
created, no operation is made, no sequence number is taken, and the training client goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import asyncsess
from asyncsess.errors import InvalidInputError
from asyncsess.types import AdamParams, Datum, ModelInput

from .helpers import clients, driver_url

pytestmark = [pytest.mark.sagemaker, pytest.mark.anyio]

BASE = "mock/bigram-tiny"
GOOD = [Datum(model_input=ModelInput.from_ints([1, 40, 41]), loss_fn_inputs={"target_tokens": [40, 41, 42], "weights": [1.0] * 3})]
PKG = "arn:aws:sagemaker:us-west-2:111122223333:model-package/sagemaker-default/{}"
NAMES = {"NUL": "a\x00b", "lone surrogate": "a\ud800b", "5000 characters": "a" * 5000}
ARNS = {
    "another account": PKG.replace("111122223333", "999999999999").format(1),
    "another region": PKG.replace("us-west-2", "eu-west-1").format(1),
    "another partition": PKG.replace("arn:aws:", "arn:aws-cn:").format(1),
    "a group, not a version": "arn:aws:sagemaker:us-west-2:111122223333:model-package-group/sagemaker-default",
    "NUL": PKG.format("1\x00"),
    "lone surrogate": PKG.format("1\ud800"),
    "5000 characters": PKG.replace("sagemaker-default", "g" * 5000).format(1),
    "version past 64 bits": PKG.format("9" * 40),
    "version 0": PKG.format(0),
    "version of 5000 digits": PKG.format("9" * 5000),
}
ADAM = {
    "learning_rate NaN": {"learning_rate": float("nan")},
    "learning_rate inf": {"learning_rate": float("inf")},
    "learning_rate 10**400": {"learning_rate": 10**400},
    "learning_rate above 0.01": {"learning_rate": 0.02},
    "learning_rate 0": {"learning_rate": 0.0},
    "eps subnormal": {"learning_rate": 1e-3, "eps": 5e-324},
    "beta2 -0.1": {"learning_rate": 1e-3, "beta2": -0.1},
    "weight_decay NaN": {"learning_rate": 1e-3, "weight_decay": float("nan")},
    "grad_clip_norm 1e9": {"learning_rate": 1e-3, "grad_clip_norm": 1e9},
}


def _cases() -> list[tuple[str, str, Callable[[Any, Any], Any]]]:
    """(case id, the field the error must name, the call on (ServiceClient, TrainingClient))."""
    out: list[tuple[str, str, Callable[[Any, Any], Any]]] = []
    for what, name in NAMES.items():
        out.append((f"save_state name {what}", "name", lambda svc, tc, v=name: tc.save_state(v)))
        out.append((f"save_state description {what}", "description", lambda svc, tc, v=name: tc.save_state(description=v)))
        out.append((f"sampler description {what}", "description", lambda svc, tc, v=name: tc.save_weights_for_sampler(description=v)))
        out.append(
            (
                f"session name {what}",
                "training_session_name",
                lambda svc, tc, v=name: svc.create_lora_training_client(BASE, rank=4, training_session_name=v),
            )
        )
        out.append((f"base model {what}", "base_model", lambda svc, tc, v=name: svc.create_lora_training_client(v, rank=4)))
    for what, arn in ARNS.items():
        out.append((f"load_state {what}", "path", lambda svc, tc, v=arn: tc.load_state(v)))
        out.append((f"load_state_with_optimizer {what}", "path", lambda svc, tc, v=arn: tc.load_state_with_optimizer(v)))
        out.append((f"resume {what}", "path", lambda svc, tc, v=arn: svc.create_training_client_from_state(v, rank=4)))
        out.append((f"sampler {what}", "model_path", lambda svc, tc, v=arn: svc.create_sampling_client(model_path=v)))
    for what, params in ADAM.items():
        out.append(
            (
                f"optim_step {what}",
                "learning_rate|learningRate|beta2|eps|weight_decay|grad_clip_norm|gradClipNorm",
                lambda svc, tc, v=params: tc.optim_step(v),
            )
        )
    return out


CASES = _cases()


async def test_hostile_names_arns_and_numbers_are_refused_naming_the_field_before_anything_is_sent(emulator):
    sm = clients(emulator.url)[0]
    failures = []
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        sessions = len(sm.list_training_sessions()["TrainingSessionSummaries"])
        for case, fields, call in CASES:
            try:
                result = call(svc, tc)
                if hasattr(result, "__await__"):
                    await result
            except InvalidInputError as err:
                named = f"{err.field} {err}"
                if not any(f in named for f in fields.split("|")):
                    failures.append(f"{case}: names {err.field!r}: {str(err)[:120]}")
            except Exception as err:  # an untyped error, or a typed one of another kind
                failures.append(f"{case}: {type(err).__name__}: {str(err)[:120]}")
            else:
                failures.append(f"{case}: taken")
        assert not failures, "\n".join(failures)
        assert len(sm.list_training_sessions()["TrainingSessionSummaries"]) == sessions  # no session was created
        assert tc.current_sequence_number == 0 and emulator.session_state(tc.model_id)["operations"] == {}  # nothing sent
        await tc.forward_backward(GOOD, "cross_entropy")
        assert (await tc.optim_step(AdamParams(learning_rate=0.01))).step == 1
        assert emulator.session_state(tc.model_id)["applied"] == [1, 2]


@pytest.mark.parametrize(
    "option",
    ["poll_initial_s=inf", "poll_max_s=1e400", "retry_budget_s=Infinity", "create_timeout_s=nan", "max_pool_connections=1000000000"],
)
async def test_an_endless_or_huge_driver_option_is_refused_naming_it_before_any_call(emulator, option):
    """poll_initial_s=inf slept for good before the first poll, retry_budget_s=inf retried a throttled call for good, and
    max_pool_connections=10**9 made urllib3 fill a billion-slot queue at the first call."""
    name, value = option.split("=")
    sm = clients(emulator.url)[0]
    sessions = len(sm.list_training_sessions()["TrainingSessionSummaries"])
    with pytest.raises(InvalidInputError) as err:
        async with asyncsess.ServiceClient(driver_url(emulator, **{name: value})) as svc:
            await svc.create_lora_training_client(BASE, rank=4)
    assert err.value.field == f"sagemaker option {name}", err.value
    assert len(sm.list_training_sessions()["TrainingSessionSummaries"]) == sessions
