"""Training on one LoRA adapter: packed forward(-backward) over many ops at once, and AdamW steps.

Gradients accumulate in the adapter's parameters until ``optim_step``. Several ``forward_backward``
ops queued together run as one pass split into token-budget micro-batches; since every loss is a sum,
that yields the same gradient as running them one by one (up to float rounding).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from asyncsess.backends import PassOp
from asyncsess.errors import NonFiniteGradientError
from asyncsess.types import AdamParams, ForwardBackwardOutput, OptimStepResponse, TensorData, Usage

from .adapters import LoraHost
from .logprobs import packed_logprobs
from .losses import datum_loss
from .prefix import PrefixGroup, find_groups, split_group

__all__ = [
    "TrainSession",
    "run_ops",
    "optim_step",
    "new_optimizer",
    "optimizer_tensors",
    "load_optimizer_tensors",
    "checkpoint_layers",
    "is_oom",
    "free_memory",
    "save_grads",
    "restore_grads",
    "single_datum_batches",
    "micro_batches",
]


@dataclass
class TrainSession:
    """One training session: a trainable adapter with its own AdamW state."""

    model_id: str
    base_model: str
    adapter: str
    rank: int
    alpha: float
    targets: list[str]
    seed: int | None
    params: dict[str, nn.Parameter]
    optimizer: torch.optim.AdamW
    step: int = 0
    failed: BaseException | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def new_optimizer(params: dict[str, nn.Parameter], *, fused: bool = False) -> torch.optim.AdamW:
    """Full-precision AdamW with two groups (LoRA A, LoRA B) so LoRA+ can scale B's learning rate.

    ``fused`` (the engine sets it on CUDA) runs one kernel over all parameters instead of a loop of them.
    """
    a = [p for k, p in params.items() if ".lora_B." not in k]
    b = [p for k, p in params.items() if ".lora_B." in k]
    kw: dict[str, Any] = {"fused": True} if fused else {}
    return torch.optim.AdamW([{"params": a}, {"params": b}], lr=0.0, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0, **kw)


def _pack_budget(lengths: list[int], budget: int) -> list[list[int]]:
    """Greedy micro-batches of datum indices with at most ``budget`` tokens each (a longer datum goes alone)."""
    batches: list[list[int]] = []
    used = budget
    for i, n in enumerate(lengths):
        if used + n > budget:
            batches.append([])
            used = 0
        batches[-1].append(i)
        used += n
    return batches


def micro_batches(tokens: Sequence[list[int]], budget: int, shared_prefix: int = 0) -> list[list[PrefixGroup]]:
    """Datums in micro-batches of at most ``budget`` packed tokens, as prefix groups (a datum alone: a group of one).

    ``shared_prefix`` ≤ 0 keeps the datums' order and one group per datum; otherwise datums sharing at
    least ``shared_prefix`` leading tokens form groups that count their prefix once against the budget.
    """
    lengths = [len(t) for t in tokens]
    if shared_prefix <= 0:
        return [[PrefixGroup(0, (i,)) for i in batch] for batch in _pack_budget(lengths, budget)]
    groups = [part for g in find_groups(tokens, shared_prefix) for part in split_group(g, lengths, budget)]
    spans = [g.span(lengths) for g in groups]
    return [[groups[k] for k in batch] for batch in _pack_budget(spans, budget)]


def single_datum_batches(lengths: list[int], budget: int) -> bool:
    """Whether ``budget`` already puts every datum in a micro-batch of its own (it cannot be split further)."""
    return len(_pack_budget(lengths, budget)) == len(lengths)


def is_oom(err: BaseException) -> bool:
    """Whether ``err`` is the device running out of memory (CUDA's, or any backend's ``out of memory``)."""
    return isinstance(err, torch.OutOfMemoryError) or (isinstance(err, RuntimeError) and "out of memory" in str(err).lower())


def free_memory(device: torch.device) -> None:
    """Return cached blocks to the device after a failure (call it once the exception is released)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def save_grads(sess: TrainSession) -> dict[str, Tensor | None]:
    """The accumulated gradients, to put back if a pass fails halfway through its micro-batches."""
    return {k: None if p.grad is None else p.grad.clone() for k, p in sess.params.items()}


def restore_grads(sess: TrainSession, saved: dict[str, Tensor | None]) -> None:
    for k, p in sess.params.items():
        p.grad = saved[k]


def _decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    get_decoder: Any = getattr(model, "get_decoder", None)
    decoder: nn.Module = get_decoder() if callable(get_decoder) else model
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    return next((m for m in decoder.modules() if isinstance(m, nn.ModuleList) and len(m) > 0), None)


def checkpoint_layers(model: nn.Module) -> int:
    """Recompute each decoder layer's activations in backward instead of keeping them; returns the layer count.

    Wraps each layer's ``forward`` (instance attribute, so it works on any transformers version and
    whatever the module's train/eval mode) in non-reentrant :func:`torch.utils.checkpoint.checkpoint`
    when autograd is on; inference passes run as before. Only a layer's input is kept for backward,
    which also drops the fp32 copies of LoRA inputs that peft keeps inside the layer.
    """
    layers = _decoder_layers(model)
    if layers is None:
        return 0
    for layer in layers:
        if getattr(layer, "_asyncsess_checkpointed", False):
            continue
        inner = layer.forward

        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            if torch.is_grad_enabled():
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
            return _inner(*args, **kwargs)

        layer.forward = forward  # type: ignore[method-assign]
        layer._asyncsess_checkpointed = True  # type: ignore[assignment]
    return len(layers)


def _tensor(value: TensorData, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A checked TensorData as a tensor of its own shape."""
    t = torch.tensor(value.data, dtype=dtype, device=device)
    return t.reshape(value.shape) if value.shape else t


def run_ops(
    host: LoraHost,
    sess: TrainSession,
    ops: Sequence[PassOp],
    *,
    backward: bool,
    device: torch.device,
    token_budget: int,
    chunk: int,
    plain_head: bool,
    shared_prefix: int = 0,
) -> list[ForwardBackwardOutput]:
    """Run ``forward`` (``backward=False``) or ``forward_backward`` ops of one session in one pass.

    ``shared_prefix`` > 0: datums sharing at least that many leading tokens run the prefix once (prefix.py).
    """
    host.activate(sess.adapter, trainable=backward)
    model = host.peft.get_base_model()
    items: list[tuple[int, Any]] = [(oi, d) for oi, op in enumerate(ops) for d in op.data]
    tokens = [d.model_input.to_ints() for _, d in items]
    lengths = [len(t) for t in tokens]
    logprobs: list[Tensor | None] = [None] * len(items)
    loss_sums = [0.0] * len(ops)
    for groups in micro_batches(tokens, token_budget, shared_prefix):
        batch = [i for g in groups for i in g.members]
        local = {i: k for k, i in enumerate(batch)}
        seqs, inputs = [], []
        for i in batch:
            d = items[i][1]
            ids = torch.tensor(tokens[i], dtype=torch.long, device=device)
            lfi = d.loss_fn_inputs
            seqs.append((ids, _tensor(lfi["target_tokens"], torch.long, device)))  # (n,) or (n, K)
            inputs.append({k: _tensor(v, torch.float32, device) for k, v in lfi.items() if k != "target_tokens"})
        shared = [PrefixGroup(g.prefix, tuple(local[i] for i in g.members)) for g in groups]
        with torch.set_grad_enabled(backward):
            lps = packed_logprobs(model, seqs, chunk=chunk, plain_head=plain_head, groups=shared)
            losses = []
            for i, lp, inp in zip(batch, lps, inputs):
                op = ops[items[i][0]]
                losses.append(datum_loss(op.loss_fn or "cross_entropy", lp, inp, op.loss_fn_config))
            total = torch.stack(losses).sum()
            if backward and total.requires_grad:
                total.backward()
        # one device-to-host copy per micro-batch, not one per datum
        values = torch.stack([x.detach().float() for x in losses]).cpu().tolist()
        flat = torch.cat([lp.detach().float().reshape(-1) for lp in lps]).cpu()
        for i, value, lp, src in zip(batch, values, flat.split([x.numel() for x in lps]), lps):
            loss_sums[items[i][0]] += value
            logprobs[i] = lp.reshape(src.shape)
    outputs = []
    for oi in range(len(ops)):
        mine = [i for i, (o, _) in enumerate(items) if o == oi]
        outputs.append(
            ForwardBackwardOutput(
                loss_fn_output_type="TensorData",
                loss_fn_outputs=[{"logprobs": TensorData.from_torch(logprobs[i])} for i in mine],  # type: ignore[arg-type]
                metrics={"loss:sum": loss_sums[oi]},
                usage=Usage(training_tokens=sum(lengths[i] for i in mine)),
            )
        )
    return outputs


def optim_step(sess: TrainSession, adam: AdamParams) -> OptimStepResponse:
    """One AdamW step with ``adam``'s settings (weight decay, grad-norm clip, LoRA+ ratio); zero the grads.

    A gradient whose norm is NaN or infinite is zeroed without a step: :class:`NonFiniteGradientError`.
    """
    params = list(sess.params.values())
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    norm = float(total)
    if not math.isfinite(norm):
        sess.optimizer.zero_grad(set_to_none=True)
        raise NonFiniteGradientError(norm)
    if adam.grad_clip_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, adam.grad_clip_norm, total)
    ratio = adam.lora_plus_lr_ratio or 1.0
    for gi, group in enumerate(sess.optimizer.param_groups):
        group.update(
            lr=adam.learning_rate * (ratio if gi == 1 else 1.0),
            betas=(adam.beta1, adam.beta2),
            eps=adam.eps,
            weight_decay=adam.weight_decay,
        )
    sess.optimizer.step()
    sess.optimizer.zero_grad(set_to_none=True)
    sess.step += 1
    return OptimStepResponse(step=sess.step, metrics={"grad_norm": norm, "learning_rate": adam.learning_rate})


def optimizer_tensors(sess: TrainSession) -> dict[str, Tensor]:
    """AdamW moments and step counts under ``<param key>::<field>`` (safetensors-friendly)."""
    out: dict[str, Tensor] = {}
    for key, p in sess.params.items():
        for name, value in sess.optimizer.state.get(p, {}).items():
            out[f"{key}::{name}"] = value.detach().cpu().contiguous()
    return out


def load_optimizer_tensors(sess: TrainSession, tensors: dict[str, Tensor]) -> None:
    sess.optimizer.state.clear()
    fused = bool(sess.optimizer.defaults.get("fused"))  # the fused kernel keeps the step count on the device
    for key, p in sess.params.items():
        state = {name.split("::", 1)[1]: t for name, t in tensors.items() if name.split("::", 1)[0] == key}
        if state:
            sess.optimizer.state[p] = {
                name: ((t.to(p.device) if fused else t).clone() if name == "step" else t.to(p.device, p.dtype).clone())
                for name, t in state.items()
            }
