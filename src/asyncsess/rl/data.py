"""RL math (torch-free): group advantages, the KL penalty, sampler-vs-trainer KL metrics, and datum
builders (one completion, a whole trajectory, a group). Formulas follow tinker-cookbook's ``rl/data_processing``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import InvalidInputError
from ..types import Datum, ModelInput, TensorData
from .types import Trajectory, TrajectoryGroup

__all__ = [
    "center_advantages",
    "is_constant",
    "kl_penalty",
    "sample_train_kl",
    "rl_datum",
    "sft_datum",
    "datum_tokens",
    "trajectory_datums",
    "group_datums",
]


def center_advantages(rewards: Sequence[float], normalize_std: bool = False, eps: float = 1e-6) -> list[float]:
    """GRPO group advantages: ``R - mean(R)``, optionally divided by the group's std."""
    r = np.asarray(rewards, dtype=np.float64)
    a = r - r.mean()
    if normalize_std:
        a = a / (r.std() + eps)
    return a.tolist()


def is_constant(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards are all equal (its centred advantages are all zero: no signal)."""
    return len(set(rewards)) <= 1


def kl_penalty(
    sampler_logprobs: Sequence[Sequence[float]], ref_logprobs: Sequence[Sequence[float]], masks: Sequence[Sequence[float]], coef: float
) -> list[list[float]]:
    """Per-token advantage deltas of the cookbook's KL penalty: with ``d = (q - ref)·mask`` and
    ``avg = Σd / Σmask`` over the whole batch, ``ΔA = coef · mask · (avg - d)``."""
    d = [np.asarray(q, np.float64) - np.asarray(r, np.float64) for q, r in zip(sampler_logprobs, ref_logprobs)]
    m = [np.asarray(x, np.float64) for x in masks]
    d = [di * mi for di, mi in zip(d, m)]
    total = sum(float(x.sum()) for x in m)
    avg = sum(float(x.sum()) for x in d) / total if total else 0.0
    return [(coef * mi * (avg - di)).tolist() for di, mi in zip(d, m)]


def sample_train_kl(
    sampler_logprobs: Sequence[Sequence[float]], trainer_logprobs: Sequence[Sequence[float]], masks: Sequence[Sequence[float]]
) -> dict[str, float]:
    """How far the trainer's log-probs ``p`` moved from the sampler's ``q`` on the masked tokens:
    ``optim/kl_sample_train_v1 = mean(q - p)``, ``..._v2 = ½·mean((q - p)²)``, ``optim/entropy = -mean(q)``."""
    m = np.concatenate([np.asarray(x, np.float64) for x in masks]) > 0 if masks else np.zeros(0, bool)
    if not m.any():
        return {}
    q = np.concatenate([np.asarray(x, np.float64) for x in sampler_logprobs])[m]
    p = np.concatenate([np.asarray(x, np.float64) for x in trainer_logprobs])[m]
    diff = q - p
    return {
        "optim/kl_sample_train_v1": float(diff.mean()),
        "optim/kl_sample_train_v2": float(0.5 * (diff**2).mean()),
        "optim/entropy": float(-q.mean()),
    }


def rl_datum(prompt: Sequence[int], completion: Sequence[int], logprobs: Sequence[float], advantage: float) -> Datum:
    """One sampled completion as an RL datum: prompt positions get advantage 0, completion tokens get
    their sampler log-probs and ``advantage``. Input position *t* predicts ``target_tokens[t]``."""
    if len(logprobs) != len(completion):
        raise ValueError(f"{len(completion)} completion tokens but {len(logprobs)} log-probs")
    _check_prompt(prompt)
    full = [*prompt, *completion]
    n = len(full) - 1
    n_prompt = len(prompt) - 1  # positions that predict prompt tokens
    adv = [0.0] * n_prompt + [float(advantage)] * len(completion)
    lps = [0.0] * n_prompt + [float(x) for x in logprobs]
    return Datum.model_construct(
        model_input=ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData.model_construct(data=full[1:], dtype="int64", shape=[n]),
            "logprobs": TensorData.model_construct(data=lps, dtype="float32", shape=[n]),
            "advantages": TensorData.model_construct(data=adv, dtype="float32", shape=[n]),
        },
    )


def sft_datum(prompt: Sequence[int], completion: Sequence[int], weight: float = 1.0) -> Datum:
    """Supervised datum training on ``completion`` only (prompt positions weighted 0)."""
    _check_prompt(prompt)
    full = [*prompt, *completion]
    n = len(full) - 1
    n_prompt = len(prompt) - 1
    weights = [0.0] * n_prompt + [float(weight)] * len(completion)
    return Datum.model_construct(
        model_input=ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData.model_construct(data=full[1:], dtype="int64", shape=[n]),
            "weights": TensorData.model_construct(data=weights, dtype="float32", shape=[n]),
        },
    )


def _check_prompt(prompt: Sequence[int]) -> None:
    """A datum's first input token is its prompt's: with none, each per-token list came out one longer than the targets."""
    if len(prompt) == 0:
        raise InvalidInputError("is empty", field="prompt", fix="start with at least one token (e.g. the tokenizer's bos_token_id)")


def datum_tokens(datum: Datum) -> list[int]:
    """The whole sequence a next-token datum covers: its input plus the last target token."""
    return [*datum.model_input.to_ints(), int(datum.loss_fn_inputs["target_tokens"].data[-1])]


def trajectory_datums(trajectory: Trajectory, advantage: float) -> list[tuple[Datum, list[float]]]:
    """RL datums of one trajectory with its action masks.

    Turns are merged while each observation starts with everything so far (previous observations and
    actions); otherwise a new datum starts. Action tokens carry their sampler log-probs and ``advantage``;
    observation tokens carry log-prob 0 and advantage 0 (mask 0). A one-step trajectory gives what
    :func:`rl_datum` gives for its prompt and completion.
    """
    out: list[tuple[Datum, list[float]]] = []
    tokens: list[int] = []
    logprobs: list[float] = []
    mask: list[float] = []

    def flush() -> None:
        if len(tokens) > 1 and any(mask[1:]):
            n = len(tokens) - 1
            adv = [advantage * m for m in mask[1:]]
            datum = Datum.model_construct(
                model_input=ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": TensorData.model_construct(data=tokens[1:], dtype="int64", shape=[n]),
                    "logprobs": TensorData.model_construct(data=logprobs[1:], dtype="float32", shape=[n]),
                    "advantages": TensorData.model_construct(data=adv, dtype="float32", shape=[n]),
                },
            )
            out.append((datum, mask[1:]))
        del tokens[:], logprobs[:], mask[:]

    def add(new: Sequence[int], lps: Sequence[float], m: float) -> None:
        tokens.extend(new)
        logprobs.extend(lps)
        mask.extend([m] * len(new))

    for t in trajectory.transitions:
        ob = t.ob.to_ints()
        if len(t.ac.logprobs) != len(t.ac.tokens):
            raise ValueError(f"{len(t.ac.tokens)} action tokens but {len(t.ac.logprobs)} log-probs")
        if not tokens or ob[: len(tokens)] != tokens:
            flush()
        new = ob[len(tokens) :]
        add(new, [0.0] * len(new), 0.0)
        add(t.ac.tokens, t.ac.logprobs, 1.0)
    flush()
    return out


def group_datums(group: TrajectoryGroup, normalize_std: bool = False) -> list[tuple[Datum, list[float]]]:
    """Datums of the group's trajectories with a non-zero centred advantage ``R - mean(R)`` (optionally
    divided by the group's std), with their action masks."""
    out = []
    for trajectory, adv in zip(group.trajectories, center_advantages(group.total_rewards, normalize_std=normalize_std)):
        if adv != 0.0:
            out.extend(trajectory_datums(trajectory, adv))
    return out
