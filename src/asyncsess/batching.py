"""Splitting large batches into chunks the backend accepts, and merging their outputs back.

Limits follow the anchors (≤1024 datums and ≈5 MB estimated per request, 4 bytes per value). Chunks get
consecutive sequence numbers; since gradients accumulate until ``optim_step`` and every loss is
sum-reduced, a chunked batch trains exactly like an unchunked one.
"""

from __future__ import annotations

from collections.abc import Sequence

from .types import Datum, ForwardBackwardOutput, Usage

__all__ = ["estimate_bytes", "chunk_datums", "merge_outputs"]


def estimate_bytes(datum: Datum) -> int:
    return 4 * (datum.model_input.length + sum(len(t.data) for t in datum.loss_fn_inputs.values()))


def chunk_datums(datums: Sequence[Datum], max_datums: int, max_bytes: int) -> list[tuple[Datum, ...]]:
    """Greedy split keeping order; a single datum over ``max_bytes`` travels alone."""
    chunks: list[tuple[Datum, ...]] = []
    current: list[Datum] = []
    size = 0
    for d in datums:
        n = estimate_bytes(d)
        if current and (len(current) >= max_datums or size + n > max_bytes):
            chunks.append(tuple(current))
            current, size = [], 0
        current.append(d)
        size += n
    if current:
        chunks.append(tuple(current))
    return chunks


def merge_outputs(outputs: Sequence[ForwardBackwardOutput]) -> ForwardBackwardOutput:
    """Concatenate per-datum outputs; merge metrics by their suffix (``:sum`` adds, ``:max``/``:min``
    take the extreme, anything else is a datum-weighted mean); add usage."""
    if len(outputs) == 1:
        return outputs[0]
    sizes = [len(o.loss_fn_outputs) for o in outputs]
    total = sum(sizes) or 1
    metrics: dict[str, float] = {}
    for key in dict.fromkeys(k for o in outputs for k in o.metrics):
        values = [(o.metrics[key], n) for o, n in zip(outputs, sizes) if key in o.metrics]
        if key.endswith(":sum"):
            metrics[key] = sum(v for v, _ in values)
        elif key.endswith(":max"):
            metrics[key] = max(v for v, _ in values)
        elif key.endswith(":min"):
            metrics[key] = min(v for v, _ in values)
        else:
            metrics[key] = sum(v * n for v, n in values) / total
    usage = Usage()
    for o in outputs:
        usage = usage + o.usage
    return ForwardBackwardOutput.model_construct(
        loss_fn_output_type=outputs[0].loss_fn_output_type,
        loss_fn_outputs=[x for o in outputs for x in o.loss_fn_outputs],
        metrics=metrics,
        usage=usage,
    )
