"""Run every bad-input case on one client of a backend (for backends too slow to open one per case)."""

from __future__ import annotations

from typing import Any

from asyncsess import ServiceClient

from . import cases


def one_per_kind() -> frozenset[str]:
    """The names of all cases but the first of each op kind (``fb``, ``optim``, ``save``, ``sample``, ...)."""
    seen: set[str] = set()
    skip = set()
    for name, *_ in cases.CASES:
        kind = name.split("-")[0]
        if kind in seen:
            skip.add(name)
        seen.add(kind)
    return frozenset(skip)


async def run_all(url: str, base_model: str, options: dict[str, Any] | None = None, skip: frozenset[str] = frozenset()) -> int:
    """Every case in turn, each followed by a forward_backward + optim_step + sample; returns how many ran."""
    cases.BASE = base_model
    ran = 0
    async with ServiceClient(url, **(options or {})) as svc:
        tc = await svc.create_lora_training_client(base_model, rank=4)
        sc = await tc.save_weights_and_get_sampling_client()
        await tc.save_state(cases.TAKEN)
        await tc.save_weights_for_sampler(cases.TAKEN)
        for name, target, call, field in cases.CASES:
            if name in skip:
                continue
            before = tc.current_sequence_number
            obj = {"tc": tc, "sc": sc, "svc": svc}[target]
            try:
                await cases.expect_rejected(lambda call=call, obj=obj: call(obj), field)
                await cases.check_still_works(tc, sc, before)
            except AssertionError as err:
                raise AssertionError(f"case {name}: {err}") from err
            ran += 1
    return ran
