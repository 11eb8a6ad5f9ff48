"""RL loop helpers shared by the recipes: group advantages and datum builders (torch-free)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .types import Datum, ModelInput, TensorData

__all__ = ["center_advantages", "rl_datum", "sft_datum"]


def center_advantages(rewards: Sequence[float], normalize_std: bool = False, eps: float = 1e-6) -> list[float]:
    """GRPO group advantages: ``R - mean(R)``, optionally divided by the group's std."""
    r = np.asarray(rewards, dtype=np.float64)
    a = r - r.mean()
    if normalize_std:
        a = a / (r.std() + eps)
    return a.tolist()


def rl_datum(prompt: Sequence[int], completion: Sequence[int], logprobs: Sequence[float], advantage: float) -> Datum:
    """One sampled completion as an RL datum: prompt positions get advantage 0, completion tokens get
    their sampler log-probs and ``advantage``. Input position *t* predicts ``target_tokens[t]``."""
    if len(logprobs) != len(completion):
        raise ValueError(f"{len(completion)} completion tokens but {len(logprobs)} log-probs")
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
