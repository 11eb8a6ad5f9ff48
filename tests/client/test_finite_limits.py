"""The shared wire types refuse non-finite and out-of-range numbers (issue 11), so every backend, the
in-process ones included, refuses what the HTTP worker refuses; the client refuses it before sending."""

import pytest
from pydantic import ValidationError

from asyncsess import AdamParams, InvalidInputError, SamplingParams, ServiceClient
from asyncsess.types import MAX_SEED
from asyncsess.validation import check_datums, check_loss_fn_config

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": NAN},
        {"temperature": INF},
        {"top_p": NAN},
        {"seed": -1},
        {"seed": MAX_SEED + 1},
        {"seed": 10**40},
        {"stop": ""},
        {"stop": ["ok", ""]},
        {"stop": ["x" * 1001]},
        {"stop": ["s"] * 65},
    ],
)
def test_sampling_params_refuse(kw):
    with pytest.raises(ValidationError):
        SamplingParams(**kw)


def test_sampling_params_edges_that_stay_valid():
    assert SamplingParams(seed=0).seed == 0 and SamplingParams(seed=MAX_SEED).seed == MAX_SEED
    assert SamplingParams(temperature=5e-324).temperature == 5e-324  # tiny but finite: backends decode greedily
    assert SamplingParams(stop=[]).stop == [] and SamplingParams(stop=["\n", 2]).stop_token_ids() == [2]


@pytest.mark.parametrize(
    "kw",
    [
        {"learning_rate": INF},
        {"learning_rate": NAN},
        {"learning_rate": 1e30},
        {"learning_rate": 1e39},
        {"eps": 0.0},
        {"eps": INF},
        {"eps": 1e-46},  # 0 in float32: a zero gradient's update was 0 / 0, the weights NaN
        {"eps": 1e-40},  # a float32 subnormal (a GPU kernel may flush it to 0)
        {"weight_decay": NAN},
        {"weight_decay": 2.0},
        {"learning_rate": 10.0, "weight_decay": 0.2},  # each weight times 1 - 2 = -1 per step
        {"learning_rate": 3.0, "weight_decay": 1.0},  # times -2: inf within ~20 steps
        {"learning_rate": 0.01, "lora_plus_lr_ratio": 1000.0, "weight_decay": 0.5},  # LoRA B's times -4: NaN at step 21
        {"grad_clip_norm": INF},
        {"lora_plus_lr_ratio": INF},
        {"learning_rate": 10.0, "lora_plus_lr_ratio": 1000.0},  # LoRA B's rate 10,000
        {"learning_rate": 0.1, "lora_plus_lr_ratio": 101.0},  # 10.1: past the largest learning_rate taken
    ],
)
def test_adam_params_refuse(kw):
    with pytest.raises(ValidationError):
        AdamParams(**kw)


def test_lora_plus_keeps_b_under_the_largest_learning_rate_and_names_the_ratio():
    assert AdamParams(learning_rate=0.01, lora_plus_lr_ratio=1000.0).lora_plus_lr_ratio == 1000.0  # B at 10: the edge
    assert AdamParams(learning_rate=2e-4, lora_plus_lr_ratio=16.0).lora_plus_lr_ratio == 16.0  # LoRA+'s usual setting
    with pytest.raises(ValidationError) as err:
        AdamParams(learning_rate=1.0, lora_plus_lr_ratio=16.0)
    assert err.value.errors()[0]["loc"] == ("lora_plus_lr_ratio",) and "LoRA B" in str(err.value)


@pytest.mark.parametrize("bad", [NAN, INF, -INF, 1e39, 2**200])
def test_check_datums_refuses_non_finite_float32(bad):
    datum = {"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 3], "weights": [1.0, bad]}}
    with pytest.raises(InvalidInputError) as err:
        check_datums([datum], "cross_entropy")
    assert err.value.field == "data[0].loss_fn_inputs['weights']" and err.value.fix
    ok = {"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 3], "weights": [5e-324, -1e6]}}
    assert check_datums([ok], "cross_entropy")


@pytest.mark.parametrize("bad", [NAN, INF, "nan"])
def test_loss_config_values_are_finite(bad):
    with pytest.raises(InvalidInputError) as err:
        check_loss_fn_config("ppo", {"clip_low_threshold": bad})
    assert "clip_low_threshold" in err.value.field


@pytest.mark.parametrize("low", [1e308, 1.5, 1.0000001])
def test_the_clip_bounds_never_cross(low):
    """clip_low_threshold 1e308 with clip_high_threshold 1.2 was taken: low above high (SageMaker allows 0–1)."""
    with pytest.raises(InvalidInputError) as err:
        check_loss_fn_config("ppo", {"clip_low_threshold": low, "clip_high_threshold": 1.2})
    assert err.value.field == "loss_fn_config['clip_low_threshold']" and err.value.fix
    assert check_loss_fn_config("cispo", {"clip_low_threshold": 1.0, "clip_high_threshold": 1.0}) == {
        "clip_low_threshold": 1.0,
        "clip_high_threshold": 1.0,
    }


@pytest.mark.anyio
async def test_the_client_refuses_before_sending():
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        with pytest.raises(InvalidInputError, match="adam_params.learning_rate"):
            tc.optim_step({"learning_rate": INF})
        sc = await tc.save_weights_and_get_sampling_client("s")
        with pytest.raises(InvalidInputError, match="sampling_params.seed"):
            sc.sample([1, 2], 1, {"seed": -1})


RL_LOSSES = ["importance_sampling", "ppo", "cispo", "dro", "gspo"]


def _rl(q):
    return {"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 3], "logprobs": [-0.5, q], "advantages": [1.0, 1.0]}}


@pytest.mark.parametrize("loss_fn", RL_LOSSES)
@pytest.mark.parametrize("bad", [50.0, 0.0011, -1e30, -1.1e6])
def test_sampler_logprobs_must_be_log_probabilities(loss_fn, bad):
    """exp(p − q) overflowed for q = +50 or −1e30 and one optim_step turned the weights to NaN."""
    with pytest.raises(InvalidInputError) as err:
        check_datums([_rl(bad)], loss_fn)
    assert err.value.field == "data[0].loss_fn_inputs['logprobs']" and err.value.fix and repr(bad) in str(err.value)


@pytest.mark.parametrize("q", [0.0, 1e-3, -1e-7, -80.0, -9999.0, -99999.0, -1e6])
def test_legal_sampler_logprobs_pass(q):
    """Float noise just above 0, a bf16 sampler's −80, vLLM's −9999 for −inf and Tinker's −99999 top-k filler."""
    assert check_datums([_rl(q)], "ppo")[0].loss_fn_inputs["logprobs"].data[1] == pytest.approx(q)


@pytest.mark.parametrize("key", ["weights", "advantages"])
@pytest.mark.parametrize("bad", [-1e30, 1e30, 1.0000001e6])
def test_token_weights_and_advantages_are_bounded(key, bad):
    """A weight of -1e30 made AdamW's second moment (g², fp32) inf: every later step of those weights was 0."""
    datum = _rl(-0.5)
    datum["loss_fn_inputs"][key] = [1.0, bad]
    with pytest.raises(InvalidInputError) as err:
        check_datums([datum], "ppo")
    assert err.value.field == f"data[0].loss_fn_inputs[{key!r}]" and err.value.fix and repr(bad) in str(err.value)
    datum["loss_fn_inputs"][key] = [1.0, -1e6]
    assert check_datums([datum], "ppo")[0].loss_fn_inputs[key].data == [1.0, -1e6]


@pytest.mark.parametrize("bad", [-1.0, 1.5, -1e-9])
def test_gspo_sequence_ratio_mask_is_a_share_in_0_1(bad):
    """The mask weights the mean log-ratio: a negative or > 1 entry made mock:// and local:// disagree."""
    datum = _rl(-0.5)
    datum["loss_fn_inputs"]["sequence_ratio_mask"] = [1.0, bad]
    with pytest.raises(InvalidInputError) as err:
        check_datums([datum], "gspo")
    assert err.value.field == "data[0].loss_fn_inputs['sequence_ratio_mask']" and err.value.fix
    datum["loss_fn_inputs"]["sequence_ratio_mask"] = [0.0, 0.5]
    assert check_datums([datum], "gspo")[0].loss_fn_inputs["sequence_ratio_mask"].data == [0.0, 0.5]
