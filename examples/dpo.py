"""DPO on chosen/rejected pairs, through ``forward_backward_custom`` (the loop:
:func:`asyncsess.supervised.preference.train_preference`; the loss: ``dpo_loss``).

The loss is lowered to ``cross_entropy`` by the client, so it runs on every backend (needs torch on the
client). Held-out pairs give ``test/accuracy``: how often the policy prefers the chosen answer more than the
reference (the weights at step 0) does. ``batch_size`` counts datums: 8 is 4 pairs.

    python examples/dpo.py                                  # mock://, seconds
    python examples/dpo.py url=local:// base_model=smollm2 learning_rate=1e-5 num_epochs=3
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio

from asyncsess.runs.checkpoints import parse_overrides
from asyncsess.supervised.preference import PreferenceConfig, train_preference

DATA = Path(__file__).parent / "data" / "preferences.jsonl"


async def main(args: list[str]) -> dict[str, Any]:
    opts = parse_overrides(args)
    run_dir = opts.pop("run_dir", "runs/dpo")
    summary = await train_preference(PreferenceConfig.model_validate({"method": "dpo", "data": str(DATA), **opts}), run_dir)
    print(summary)
    return summary


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:])
