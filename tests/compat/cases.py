"""Bad input for every op kind, shared by the mock, local and SageMaker suites.

Each case is ``(id, target, call, field)``: ``call(obj)`` must raise (or its future must fail with)
an ``InvalidInputError`` whose ``field`` contains ``field``; ``target`` says which object it gets:
the TrainingClient (``"tc"``), the SamplingClient (``"sc"``) or the ServiceClient (``"svc"``). The suites
save a checkpoint named ``TAKEN`` on the TrainingClient first.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from asyncsess import AdamParams, Datum, InvalidInputError, ModelInput, SamplingParams, TensorData
from asyncsess.futures import APIFuture

GOOD_TOKENS = [1, 40, 41, 42, 43, 2]


def datum(tokens: list[int] = GOOD_TOKENS, **inputs: Any) -> Any:
    n = len(tokens) - 1
    lfi: dict[str, Any] = {"target_tokens": tokens[1:], "weights": [1.0] * n}
    lfi.update(inputs)
    return {"model_input": ModelInput.from_ints(tokens[:-1]), "loss_fn_inputs": lfi}


def rl(**over: Any) -> Any:
    n = len(GOOD_TOKENS) - 1
    lfi: dict[str, Any] = {"target_tokens": GOOD_TOKENS[1:], "logprobs": [-1.0] * n, "advantages": [0.5] * n}
    lfi.update(over)
    return {"model_input": ModelInput.from_ints(GOOD_TOKENS[:-1]), "loss_fn_inputs": lfi}


def good_datum() -> Datum:
    return Datum.model_validate(datum())


def _sum_loss(data: Any, logprobs: Any) -> Any:
    return -sum(p.sum() for p in logprobs), {}


NAN, INF = math.nan, math.inf
LONG = "x" * 5000
SURROGATE = "\ud800"
TAKEN = "taken"  # a name the suites have saved before the cases run

Case = tuple[str, str, Callable[[Any], Any], str]

CASES: list[Case] = [
    # ---------------------------------------------------------------- forward / forward_backward
    ("fb-empty", "tc", lambda tc: tc.forward_backward([]), "data"),
    ("fb-nan-weight", "tc", lambda tc: tc.forward_backward([datum(weights=[1.0, NAN, 1.0, 1.0, 1.0])]), "weights"),
    ("fb-inf-advantage", "tc", lambda tc: tc.forward_backward([rl(advantages=[INF] * 5)], "importance_sampling"), "advantages"),
    ("fb-sampler-logprob-positive", "tc", lambda tc: tc.forward_backward([rl(logprobs=[50.0] * 5)], "importance_sampling"), "logprobs"),
    ("fb-sampler-logprob-huge-negative", "tc", lambda tc: tc.forward_backward([rl(logprobs=[-1e30] * 5)], "ppo"), "logprobs"),
    ("fb-subnormal-ok-but-wrong-length", "tc", lambda tc: tc.forward_backward([datum(weights=[5e-324] * 4)]), "weights"),
    ("fb-negative-token", "tc", lambda tc: tc.forward_backward([datum([1, -3, 41, 2])]), "data[0]"),
    ("fb-huge-token", "tc", lambda tc: tc.forward_backward([datum([1, 2**70, 41, 2])]), "data[0]"),
    ("fb-token-outside-vocab", "tc", lambda tc: tc.forward_backward([datum([1, 10**6, 41, 2])]), "data[0]"),
    (
        "fb-missing-key",
        "tc",
        lambda tc: tc.forward_backward([{"model_input": GOOD_TOKENS[:-1], "loss_fn_inputs": {"target_tokens": GOOD_TOKENS[1:]}}], "ppo"),
        "loss_fn_inputs",
    ),
    ("fb-unknown-loss", "tc", lambda tc: tc.forward_backward([datum()], "not-a-loss"), "loss_fn"),
    ("fb-bad-config-key", "tc", lambda tc: tc.forward_backward([rl()], "ppo", {"clip": 0.2}), "loss_fn_config"),
    ("fb-config-not-a-dict", "tc", lambda tc: tc.forward_backward([datum()], "cross_entropy", "clip"), "loss_fn_config"),
    ("fb-config-nan-ok-key", "tc", lambda tc: tc.forward_backward([rl()], "ppo", {"clip_low_threshold": "abc"}), "loss_fn_config"),
    # numbers only: a str or a bool where a number goes was read as float("0.8") / 1.0 and trained on
    ("fb-weights-bool-and-str", "tc", lambda tc: tc.forward_backward([datum(weights=[True, "1", 1.0, 1.0, 1.0])]), "weights"),
    ("fb-advantages-str", "tc", lambda tc: tc.forward_backward([rl(advantages=["0.5"] * 5)], "importance_sampling"), "advantages"),
    (
        "fb-target-tokens-str",
        "tc",
        lambda tc: tc.forward_backward([datum(target_tokens=[str(t) for t in GOOD_TOKENS[1:]])]),
        "target_tokens",
    ),
    (
        "fb-target-tokens-2d-bool",
        "tc",
        lambda tc: tc.forward_backward([datum(target_tokens=[[40], [41], [True], [43], [2]])]),
        "target_tokens",
    ),
    ("fb-weights-numpy-bool", "tc", lambda tc: tc.forward_backward([datum(weights=np.ones(5, dtype=bool))]), "weights"),
    ("fb-weights-numpy-str", "tc", lambda tc: tc.forward_backward([datum(weights=np.array(["1"] * 5))]), "weights"),
    (
        "fb-model-input-str",
        "tc",
        lambda tc: tc.forward_backward([{**datum(), "model_input": {"chunks": [{"tokens": ["1", "40", "41", "42", "43"]}]}}]),
        "data[0]",
    ),
    (
        "fb-model-input-float-array",
        "tc",
        lambda tc: tc.forward_backward([{**datum(), "model_input": np.array([1.0, 40, 41, 42, 43])}]),
        "data[0]",
    ),
    ("sample-prompt-bool-array", "sc", lambda sc: sc.sample(np.ones(3, dtype=bool), 1), "prompt"),
    ("fb-config-str", "tc", lambda tc: tc.forward_backward([rl()], "ppo", {"clip_low_threshold": "0.8"}), "loss_fn_config"),
    ("fb-config-bool", "tc", lambda tc: tc.forward_backward([rl()], "ppo", {"clip_high_threshold": True}), "loss_fn_config"),
    ("optim-lr-str", "tc", lambda tc: tc.optim_step({"learning_rate": "0.001"}), "adam_params.learning_rate"),
    ("sample-temperature-str", "sc", lambda sc: sc.sample(GOOD_TOKENS, 1, {"temperature": "0.5"}), "sampling_params.temperature"),
    # forward_backward_custom: the same checks as forward_backward, before either pass is numbered
    ("fbc-data-not-a-list", "tc", lambda tc: tc.forward_backward_custom(5, _sum_loss), "data"),
    ("fbc-data-empty", "tc", lambda tc: tc.forward_backward_custom([], _sum_loss), "data"),
    ("fbc-target-str", "tc", lambda tc: tc.forward_backward_custom([datum(target_tokens=["40"] * 5)], _sum_loss), "target_tokens"),
    ("fbc-no-target", "tc", lambda tc: tc.forward_backward_custom([{"model_input": [1, 40]}], _sum_loss), "loss_fn_inputs"),
    ("fbc-token-outside-vocab", "tc", lambda tc: tc.forward_backward_custom([datum([1, 10**6, 41, 2])], _sum_loss), "data[0]"),
    ("fbc-loss-not-callable", "tc", lambda tc: tc.forward_backward_custom([datum()], "cross_entropy"), "loss_fn"),
    ("fwd-empty-input", "tc", lambda tc: tc.forward([datum([1])]), "model_input"),
    ("fwd-too-long", "tc", lambda tc: tc.forward([datum([1, *([40] * 100_000), 2])]), "data[0]"),
    (
        "fwd-shared-inputs-garbage",
        "tc",
        lambda tc: tc.forward([[1, 40, 41]], "cross_entropy", None, {"target_tokens": object()}),
        "loss_fn_inputs['target_tokens']",
    ),
    (
        "fb-shared-inputs-bools",
        "tc",
        lambda tc: tc.forward_backward([[1, 40, 41]], "cross_entropy", None, {"target_tokens": [40, 41, 42], "weights": [True] * 3}),
        "loss_fn_inputs['weights']",
    ),
    # ---------------------------------------------------------------- optim_step
    ("optim-nan-lr", "tc", lambda tc: tc.optim_step({"learning_rate": NAN}), "adam_params"),
    ("optim-inf-lr", "tc", lambda tc: tc.optim_step({"learning_rate": INF}), "adam_params"),
    ("optim-negative-lr", "tc", lambda tc: tc.optim_step({"learning_rate": -1.0}), "adam_params"),
    ("optim-beta1-one", "tc", lambda tc: tc.optim_step({"beta1": 1.0}), "adam_params"),
    ("optim-both-spellings", "tc", lambda tc: tc.optim_step(AdamParams(), adam_params=AdamParams()), "adam_params"),
    ("optim-wrong-type", "tc", lambda tc: tc.optim_step("fast"), "adam_params"),
    # ---------------------------------------------------------------- save_state / save_weights_for_sampler
    ("save-name-with-slash-and-description", "tc", lambda tc: tc.save_state("a/b", description="d"), "name"),
    ("save-name-dotdot", "tc", lambda tc: tc.save_state("..", description="d"), "name"),
    ("save-name-not-str", "tc", lambda tc: tc.save_state(10**30), "name"),
    ("save-description-nul", "tc", lambda tc: tc.save_state(description="a\x00b"), "description"),
    ("save-description-surrogate", "tc", lambda tc: tc.save_state(description=SURROGATE), "description"),
    ("save-description-too-long", "tc", lambda tc: tc.save_state(description=LONG), "description"),
    ("save-positional-text-nul", "tc", lambda tc: tc.save_state("after 10 steps\x00"), "name"),
    ("save-ttl-negative", "tc", lambda tc: tc.save_state("ok", -1), "ttl_seconds"),
    ("save-ttl-float", "tc", lambda tc: tc.save_state("ok", ttl_seconds=1.5), "ttl_seconds"),
    ("save-overwrite-not-bool", "tc", lambda tc: tc.save_state("ok", overwrite="yes"), "overwrite"),
    ("save-name-taken", "tc", lambda tc: tc.save_state(TAKEN), "overwrite"),
    ("sampler-save-name-taken", "tc", lambda tc: tc.save_weights_for_sampler(TAKEN), "overwrite"),
    ("save-metadata-not-str", "tc", lambda tc: tc.save_state("ok", user_metadata={"k": 1}), "user_metadata"),
    ("save-metadata-surrogate-key", "tc", lambda tc: tc.save_state("ok", user_metadata={SURROGATE: "v"}), "user_metadata"),
    ("sampler-save-merge-not-bool", "tc", lambda tc: tc.save_weights_for_sampler("ok", "yes"), "merge_weights"),
    ("sampler-save-bad-name", "tc", lambda tc: tc.save_weights_for_sampler("-x", description="d"), "name"),
    # ---------------------------------------------------------------- load_state
    ("load-not-a-path", "tc", lambda tc: tc.load_state("not a path"), "path"),
    ("load-nul", "tc", lambda tc: tc.load_state("mock://x/weights/a\x00b"), "path"),
    ("load-none", "tc", lambda tc: tc.load_state(None), "path"),
    ("load-int", "tc", lambda tc: tc.load_state_with_optimizer(10**20), "path"),
    ("load-huge", "tc", lambda tc: tc.load_state("mock://" + LONG), "path"),
    # ---------------------------------------------------------------- sample / compute_logprobs
    ("sample-zero", "sc", lambda sc: sc.sample(GOOD_TOKENS, 0), "num_samples"),
    ("sample-bool-count", "sc", lambda sc: sc.sample(GOOD_TOKENS, True), "num_samples"),
    ("sample-too-many", "sc", lambda sc: sc.sample(GOOD_TOKENS, 10**6), "num_samples"),
    ("sample-nan-temperature", "sc", lambda sc: sc.sample(GOOD_TOKENS, 1, {"temperature": NAN}), "sampling_params"),
    ("sample-zero-max-tokens", "sc", lambda sc: sc.sample(GOOD_TOKENS, 1, {"max_tokens": 0}), "sampling_params"),
    ("sample-top-p-zero", "sc", lambda sc: sc.sample(GOOD_TOKENS, 1, {"top_p": 0.0}), "sampling_params"),
    ("sample-stop-surrogate", "sc", lambda sc: sc.sample(GOOD_TOKENS, 1, {"max_tokens": 3, "stop": ["ok", SURROGATE]}), "sampling_params"),
    ("sample-stop-too-long", "sc", lambda sc: sc.sample(GOOD_TOKENS, 1, {"max_tokens": 3, "stop": LONG}), "sampling_params"),
    ("sample-stop-bool", "sc", lambda sc: sc.sample(GOOD_TOKENS, 1, {"max_tokens": 3, "stop": ["ok", True]}), "sampling_params.stop"),
    ("sample-stop-float", "sc", lambda sc: sc.sample(GOOD_TOKENS, 1, {"max_tokens": 3, "stop": [2.0]}), "sampling_params.stop"),
    ("sample-params-wrong-type", "sc", lambda sc: sc.sample(GOOD_TOKENS, 1, "greedy"), "sampling_params"),
    ("sample-empty-prompt", "sc", lambda sc: sc.sample([], 1), "prompt"),
    ("sample-float-prompt", "sc", lambda sc: sc.sample([1.5, 2.0], 1), "prompt"),
    ("sample-topk-negative", "sc", lambda sc: sc.sample(GOOD_TOKENS, 1, topk_prompt_logprobs=-1), "topk_prompt_logprobs"),
    ("sample-topk-bool", "sc", lambda sc: sc.sample(GOOD_TOKENS, 1, topk_prompt_logprobs=False), "topk_prompt_logprobs"),
    ("sample-topk-empty-string", "sc", lambda sc: sc.sample(GOOD_TOKENS, 1, topk_prompt_logprobs=""), "topk_prompt_logprobs"),
    ("sample-topk-huge", "sc", lambda sc: sc.sample(GOOD_TOKENS, 1, topk_sample_logprobs=10**9), "topk_sample_logprobs"),
    ("sample-last-n-without-logprobs", "sc", lambda sc: sc.sample(GOOD_TOKENS, 1, prompt_logprobs_last_n=2), "prompt_logprobs_last_n"),
    (
        "sample-last-n-zero",
        "sc",
        lambda sc: sc.sample(GOOD_TOKENS, 1, include_prompt_logprobs=True, prompt_logprobs_last_n=0),
        "prompt_logprobs_last_n",
    ),
    (
        "sample-last-n-too-long",
        "sc",
        lambda sc: sc.sample(GOOD_TOKENS, 1, include_prompt_logprobs=True, prompt_logprobs_last_n=6),
        "prompt_logprobs_last_n",
    ),
    (
        "sample-target-wrong-shape",
        "sc",
        lambda sc: sc.sample(GOOD_TOKENS, 1, target_prompt_logprobs=TensorData.from_list([1, 2, 3], "int64")),
        "target_prompt_logprobs",
    ),
    (
        "sample-target-below-minus-one",
        "sc",
        lambda sc: sc.sample(GOOD_TOKENS, 1, target_prompt_logprobs=[[-2]] * 5),
        "target_prompt_logprobs",
    ),
    (  # a one-token prompt has no position to score: mock:// crashed on max() of no ids, local:// raised ValueError
        "sample-target-one-token-prompt",
        "sc",
        lambda sc: sc.sample([40], 1, target_prompt_logprobs=TensorData(data=[], dtype="int64", shape=[0, 2])),
        "target_prompt_logprobs",
    ),
    ("sample-alt-tokens", "sc", lambda sc: sc.sample(GOOD_TOKENS, 1, prompt_alt_tokens_k=2), "prompt_alt_tokens_k"),
    ("logprobs-empty", "sc", lambda sc: sc.compute_logprobs([]), "prompt"),
    ("logprobs-last-n-too-long", "sc", lambda sc: sc.compute_logprobs(GOOD_TOKENS, prompt_logprobs_last_n=99), "prompt_logprobs_last_n"),
    # ---------------------------------------------------------------- creating clients
    ("create-rank-zero", "svc", lambda svc: svc.create_lora_training_client(BASE, rank=0), "rank"),
    ("create-rank-huge", "svc", lambda svc: svc.create_lora_training_client(BASE, rank=2**40), "rank"),
    ("create-alpha-nan", "svc", lambda svc: svc.create_lora_training_client(BASE, alpha=NAN), "alpha"),
    ("create-seed-negative", "svc", lambda svc: svc.create_lora_training_client(BASE, seed=-1), "seed"),
    ("create-empty-model", "svc", lambda svc: svc.create_lora_training_client(""), "base_model"),
    ("create-model-nul", "svc", lambda svc: svc.create_lora_training_client("m\x00"), "base_model"),
    (
        "create-session-name",
        "svc",
        lambda svc: svc.create_lora_training_client(BASE, training_session_name="bad name!"),
        "training_session_name",
    ),
    ("create-s3", "svc", lambda svc: svc.create_lora_training_client(BASE, s3_output_path="http://x"), "s3_output_path"),
    (
        "create-group-arn",
        "svc",
        lambda svc: svc.create_lora_training_client(BASE, model_package_group_arn="group"),
        "model_package_group_arn",
    ),
    ("create-vpc", "svc", lambda svc: svc.create_lora_training_client(BASE, vpc_config={}), "vpc_config"),
    ("create-metadata", "svc", lambda svc: svc.create_lora_training_client(BASE, user_metadata={"a": SURROGATE}), "user_metadata"),
    ("create-optimizer", "svc", lambda svc: svc.create_lora_training_client(BASE, optimizer={"type": "dimuon"}), "optimizer"),
    ("from-state-bad-path", "svc", lambda svc: svc.create_training_client_from_state("nope"), "path"),
    ("from-state-both", "svc", lambda svc: svc.create_training_client_from_state("mock://a/weights/b", model_package_arn="arn:x"), "path"),
    (
        "from-state-unknown-option",
        "svc",
        lambda svc: svc.create_training_client_from_state("mock://a/weights/b", colour="red"),
        "session_options",
    ),
    ("sampler-both-paths", "svc", lambda svc: svc.create_sampling_client("mock://a/b/c", model_package_arn="arn:x"), "model_package_arn"),
    ("sampler-bad-path", "svc", lambda svc: svc.create_sampling_client("relative/path"), "model_path"),
    ("close-bad-status", "svc", lambda svc: svc.close("done"), "status"),
]

BASE = "mock/bigram-tiny"  # replaced per backend by the suites (see ``with_base``)


async def outcome(result: Any) -> Any:
    """Await whatever the call gave (a future or a coroutine) so errors raised inside surface."""
    if isinstance(result, APIFuture) or hasattr(result, "__await__"):
        return await result
    return result


async def expect_rejected(call: Callable[[], Any], field: str) -> InvalidInputError:
    try:
        await outcome(call())
    except InvalidInputError as err:
        assert err.field is not None and field in err.field, f"field {err.field!r} does not name {field!r}: {err}"
        assert err.fix or "fix" in str(err) or err.field, err
        return err
    raise AssertionError("accepted bad input")


async def check_still_works(tc: Any, sc: Any, before: int) -> None:
    """The rejected call consumed no sequence number, and the clients keep working."""
    assert tc.current_sequence_number == before, "a rejected op consumed a sequence number"
    fb = tc.forward_backward([good_datum()], "cross_entropy")
    opt = tc.optim_step(AdamParams(learning_rate=1e-3))
    out = await fb
    await opt
    assert math.isfinite(out.metrics["loss:sum"])
    assert (fb.seq, opt.seq) == (before + 1, before + 2)
    resp = await sc.sample(GOOD_TOKENS, 1, SamplingParams(max_tokens=2))
    assert len(resp.sequences) == 1
