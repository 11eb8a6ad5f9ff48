"""Shared-prefix training (issue 18): datums of one pass that start with the same tokens run that prefix once.

The result must be the unshared one: log-probs, loss and LoRA gradients in fp32 on the tiny model, for
mixed batches (groups of different prefix lengths, datums that share nothing, a datum equal to the prefix,
a group of one, (N, K) targets), with a chunked LM head and with decoder layers checkpointed."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from asyncsess.backends import TrainingSessionSpec  # noqa: E402
from asyncsess.types import Datum, ModelInput  # noqa: E402

from .helpers import TEST_DTYPE, Ops  # noqa: E402

pytestmark = [pytest.mark.local, pytest.mark.torch]

FP32 = TEST_DTYPE in ("float32", "fp32")


def _ids(g, n):
    return torch.randint(6, 380, (n,), generator=g).tolist()


def _mixed_batch(seed=0):
    """Token lists: a GRPO group (one 47-token prompt, 8 completions), a group with a shorter prompt that
    includes a datum equal to its prompt, a prompt with one completion, and datums sharing nothing."""
    g = torch.Generator().manual_seed(seed)
    prompt, short, lone = _ids(g, 47), _ids(g, 12), _ids(g, 30)
    out = [prompt + _ids(g, n) for n in (9, 17, 4, 12, 1, 20, 8, 15)]
    out += [short + _ids(g, n) for n in (6, 3)] + [list(short)]
    out += [lone + _ids(g, 10)]
    out += [_ids(g, n) for n in (25, 3, 40)]
    return out


def test_groups_come_from_the_token_ids():
    from asyncsess_local.prefix import PrefixGroup, find_groups, split_group

    toks = _mixed_batch()
    groups = find_groups(toks, 4)
    assert sorted(i for grp in groups for i in grp.members) == list(range(len(toks)))  # each datum once
    shared = {grp.members: grp.prefix for grp in groups if len(grp.members) > 1}
    assert {tuple(sorted(m)): p for m, p in shared.items()} == {tuple(range(8)): 47, (8, 9, 10): 12}
    for grp in groups:  # every member really starts with the prefix
        assert all(toks[i][: grp.prefix] == toks[grp.members[0]][: grp.prefix] for i in grp.members)
    assert all(len(g.members) == 1 for g in find_groups(toks, 48))  # no group shares 48 tokens
    # a longer shared prefix wins over grouping everything at a shorter one
    nested = find_groups([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [1, 2, 3, 4, 5, 8], [1, 2, 9]], 1)
    assert PrefixGroup(5, (0, 1, 2)) in nested
    # a group over the budget is cut into groups that fit, with the same prefix
    lengths = [len(t) for t in toks]
    big = next(grp for grp in groups if grp.prefix == 47)
    parts = split_group(big, lengths, 100)
    assert sorted(i for p in parts for i in p.members) == sorted(big.members)
    assert all(p.span(lengths) <= 100 or len(p.members) == 1 for p in parts) and len(parts) > 1


def _model(tiny_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir).to(dtype)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


@pytest.mark.parametrize("plain_head", [True, False])
def test_packed_logprobs_with_shared_prefixes_equal_the_unshared_ones(tiny_dir, plain_head):
    from asyncsess_local.logprobs import packed_logprobs
    from asyncsess_local.prefix import find_groups

    model = _model(tiny_dir)
    g = torch.Generator().manual_seed(1)
    toks = _mixed_batch(1)
    shapes = [(len(t), 3) if i % 5 == 0 else (len(t), 1) if i % 7 == 3 else (len(t),) for i, t in enumerate(toks)]  # (N,), (N, 1), (N, 3)
    seqs = [(torch.tensor(t), torch.randint(0, 384, shape, generator=g)) for t, shape in zip(toks, shapes)]
    weights = [torch.randn(t.shape, generator=g) for _, t in seqs]

    def run(groups):
        model.zero_grad()
        lps = packed_logprobs(model, seqs, chunk=7, plain_head=plain_head, groups=groups)
        loss = sum((w * lp).sum() for w, lp in zip(weights, lps))
        loss.backward()
        return [lp.detach() for lp in lps], loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])

    plain, loss0, grad0 = run(None)
    shared, loss1, grad1 = run(find_groups(toks, 4))
    for a, b in zip(plain, shared):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    assert abs(loss1 - loss0) <= 1e-5 * max(1.0, abs(loss0))
    assert float(torch.nn.functional.cosine_similarity(grad0, grad1, dim=0)) >= 0.99999
    assert float((grad1 - grad0).abs().max()) <= 1e-5 * float(grad0.abs().max())


def _datums(toks, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in toks:
        n = len(t) - 1
        out.append(
            Datum(
                model_input=ModelInput.from_ints(t[:-1]),
                loss_fn_inputs={
                    "target_tokens": t[1:],
                    "logprobs": (-torch.rand(n, generator=g) * 6).tolist(),
                    "advantages": torch.randn(n, generator=g).tolist(),
                },
            )
        )
    return tuple(out)


async def _run(backend_factory, tiny, data, loss_fn, monkeypatch, **kw):
    import asyncsess_local.trainer as trainer

    calls = []
    real = trainer.packed_logprobs

    def spy(model, seqs, **kw):
        calls.append(max(len(g.members) for g in kw["groups"]))
        return real(model, seqs, **kw)

    monkeypatch.setattr(trainer, "packed_logprobs", spy)
    b = backend_factory(**kw)
    try:
        await b.open()
        info = await b.create_training_session(TrainingSessionSpec(base_model=tiny, rank=4, seed=1))
        sess = b.engine.sessions[info.model_id]
        with torch.no_grad():  # non-zero B, so every LoRA parameter gets a gradient
            for k, p in sess.params.items():
                if "lora_B" in k:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(k)))
        ops = Ops()
        fwd = await b.execute_training(info.model_id, ops("forward", data=data, loss_fn=loss_fn))
        out = await b.execute_training(info.model_id, ops("forward_backward", data=data, loss_fn=loss_fn))
        grads = torch.cat([p.grad.flatten() for p in sess.params.values()])
        return fwd, out, grads, max(calls)
    finally:
        await b.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize(("loss_fn", "layers", "budget"), [("importance_sampling", "off", 8192), ("ppo", "on", 150)])
async def test_engine_shared_prefix_equals_the_unshared_pass(backend_factory, tiny, loss_fn, layers, budget, monkeypatch):
    """forward and forward_backward through the engine: same log-probs, loss and LoRA gradient.

    ``layers=on`` checkpoints every decoder layer; budget 150 cuts the 8-completion group in pieces."""
    data = _datums(_mixed_batch(2), seed=3)
    kw = {"checkpoint_layers": layers, "token_budget": budget}
    f0, o0, g0, alone = await _run(backend_factory, tiny, data, loss_fn, monkeypatch, shared_prefix=0, **kw)
    f1, o1, g1, together = await _run(backend_factory, tiny, data, loss_fn, monkeypatch, shared_prefix=4, **kw)
    assert alone == 1 and together > 1  # the second run really shared prefixes
    tol = 1e-5 if FP32 else 5e-2
    for a, b in ((f0, f1), (o0, o1)):
        assert abs(a.metrics["loss:sum"] - b.metrics["loss:sum"]) <= tol * max(1.0, abs(a.metrics["loss:sum"]))
        for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs):
            assert x["logprobs"].shape == y["logprobs"].shape
            assert max(abs(u - v) for u, v in zip(x["logprobs"].data, y["logprobs"].data)) <= tol
        assert a.usage == b.usage  # usage counts the datums' tokens, shared or not
    assert float(torch.nn.functional.cosine_similarity(g0, g1, dim=0)) >= (0.99999 if FP32 else 0.999)
    assert float((g1 - g0).abs().max()) <= tol * max(1.0, float(g0.abs().max()))


def test_micro_batches_count_a_shared_prefix_once():
    from asyncsess_local.trainer import micro_batches

    toks = _mixed_batch()
    n = sum(len(t) for t in toks)
    plain = micro_batches(toks, 300, 0)
    shared = micro_batches(toks, 300, 4)
    assert sorted(i for b in shared for g in b for i in g.members) == list(range(len(toks)))
    assert len(shared) < len(plain)
    lengths = [len(t) for t in toks]
    assert sum(g.span(lengths) for b in shared for g in b) < n  # fewer tokens through the model
    assert all(sum(g.span(lengths) for g in b) <= 300 for b in shared if len(b) > 1)
