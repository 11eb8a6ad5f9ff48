"""Shared prefixes: datums of one pass whose token ids start the same way (a GRPO group: one prompt, many
completions) run that prefix once, and each datum's own suffix on top of it.

Groups are found from the token ids alone (:func:`find_groups`): sort the datums, then split runs of
neighbours at their shortest common prefix wherever that saves more tokens. :func:`split_group` cuts a group that does
not fit a micro-batch's token budget into smaller groups with the same prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PrefixGroup", "find_groups", "split_group"]

_MAX_DEPTH = 64  # levels of nested prefixes refined (bounds the recursion for any input)


@dataclass(frozen=True)
class PrefixGroup:
    """Datums ``members`` (indices) whose first ``prefix`` tokens are the same; one member: no sharing."""

    prefix: int
    members: tuple[int, ...]

    def span(self, lengths: Sequence[int]) -> int:
        """Tokens the group occupies in a packed row: the prefix once, then every member's suffix."""
        if len(self.members) == 1:
            return lengths[self.members[0]]
        return self.prefix + sum(lengths[i] - self.prefix for i in self.members)


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)


def find_groups(tokens: Sequence[list[int]], min_prefix: int) -> list[PrefixGroup]:
    """Every datum in exactly one group; a group of two or more shares at least ``min_prefix`` (≥ 1) tokens.

    The datums are sorted, so a group is a run of neighbours and its prefix the smallest common prefix of
    adjacent ones. Each run is either kept whole or cut at that smallest common prefix, whichever saves
    more tokens (``(members − 1) · prefix`` per group), recursively: the best one-level grouping.
    """
    order = sorted(range(len(tokens)), key=lambda i: tokens[i])
    common = [_common(tokens[a], tokens[b]) for a, b in zip(order, order[1:])]
    floor = max(1, min_prefix)

    def best(lo: int, hi: int, depth: int) -> tuple[int, list[PrefixGroup]]:  # members order[lo:hi]
        if hi - lo == 1:
            return 0, [PrefixGroup(0, (order[lo],))]
        low = min(common[lo : hi - 1])
        whole = (hi - lo - 1) * low
        if depth >= _MAX_DEPTH:  # a pathological nest of prefixes: stop refining
            if low >= floor:
                return whole, [PrefixGroup(low, tuple(order[lo:hi]))]
            return 0, [PrefixGroup(0, (i,)) for i in order[lo:hi]]
        cuts = [lo] + [k + 1 for k in range(lo, hi - 1) if common[k] == low] + [hi]  # split at every shortest
        saved, groups = 0, []
        for a, b in zip(cuts, cuts[1:]):
            part = best(a, b, depth + 1)
            saved += part[0]
            groups += part[1]
        if low >= floor and whole >= saved:
            return whole, [PrefixGroup(low, tuple(order[lo:hi]))]
        return saved, groups

    return best(0, len(order), 0)[1] if order else []


def split_group(group: PrefixGroup, lengths: Sequence[int], budget: int) -> list[PrefixGroup]:
    """``group`` cut into groups of at most ``budget`` tokens each (a member that alone exceeds it goes alone)."""
    if group.span(lengths) <= budget or len(group.members) == 1:
        return [group]
    out: list[list[int]] = []
    used = budget + 1
    for i in group.members:
        extra = lengths[i] - group.prefix
        if out and used + extra <= budget:
            out[-1].append(i)
            used += extra
        else:
            out.append([i])
            used = lengths[i]
    return [PrefixGroup(group.prefix if len(m) > 1 else 0, tuple(m)) for m in out]
