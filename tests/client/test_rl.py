import pytest

from asyncsess import InvalidInputError
from asyncsess.rl.data import center_advantages, rl_datum, sft_datum

pytestmark = pytest.mark.anyio


def test_group_advantages_match_the_worked_numbers():
    assert center_advantages([1, 0, 0, 1]) == [0.5, -0.5, -0.5, 0.5]
    assert center_advantages([1.0, 0.0, -0.1, 0.0]) == pytest.approx([0.775, -0.225, -0.325, -0.225])
    assert center_advantages([1, 1, 1, 1]) == [0, 0, 0, 0]
    a = center_advantages([1, 0, 0, 1], normalize_std=True)
    assert a == pytest.approx([1, -1, -1, 1], abs=1e-5)


def test_rl_datum_masks_the_prompt_and_aligns_targets():
    d = rl_datum([1, 2, 3], [4, 5], [-0.1, -0.2], 0.5)
    assert d.model_input.to_ints() == [1, 2, 3, 4]
    assert d.loss_fn_inputs["target_tokens"].data == [2, 3, 4, 5]
    assert d.loss_fn_inputs["advantages"].data == [0, 0, 0.5, 0.5]
    assert d.loss_fn_inputs["logprobs"].data == [0, 0, -0.1, -0.2]


def test_a_datum_builder_refuses_an_empty_prompt():
    """With no prompt token, rl_datum gave one more log-prob and advantage than targets (and sft_datum one more weight)."""
    for build in (lambda: rl_datum([], [4, 5], [-0.1, -0.2], 0.5), lambda: sft_datum([], [4, 5])):
        with pytest.raises(InvalidInputError) as err:
            build()
        assert err.value.field == "prompt" and err.value.fix


async def test_grpo_example_mean_reward_rises():
    from examples.grpo_toy import train

    history, _ = await train("mock://", steps=15, seed=1)
    first, last = sum(history[:3]) / 3, sum(history[-3:]) / 3
    assert last > first + 0.2, f"mean reward went {first:.3f} -> {last:.3f}"
