"""KTO on binary feedback (each completion labelled desirable or not), through ``forward_backward_custom``
(the loop: :func:`asyncsess.supervised.preference.train_preference`; the loss: ``kto_loss``).

Held-out examples give ``test/accuracy``: how often the implicit reward ``Σ(p - ref)`` is positive for
desirable and negative for undesirable completions (the reference is the weights at step 0).

    python examples/kto.py                                  # mock://, seconds
    python examples/kto.py url=local:// base_model=smollm2 learning_rate=1e-5 num_epochs=3
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio

from asyncsess.runs.checkpoints import parse_overrides
from asyncsess.supervised.preference import PreferenceConfig, train_preference

DATA = Path(__file__).parent / "data" / "feedback.jsonl"


async def main(args: list[str]) -> dict[str, Any]:
    opts = parse_overrides(args)
    run_dir = opts.pop("run_dir", "runs/kto")
    summary = await train_preference(PreferenceConfig.model_validate({"method": "kto", "data": str(DATA), **opts}), run_dir)
    print(summary)
    return summary


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:])
