"""The CPU attention (``asyncsess_local.attention``): the same results as SDPA, forward and backward, for every
mask the sampler and the trainer make; and local:// samples and trains the same with either."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from asyncsess import InvalidInputError, SamplingParams  # noqa: E402
from asyncsess.types import Datum, ModelInput  # noqa: E402

pytestmark = [pytest.mark.local, pytest.mark.torch, pytest.mark.anyio]

F = torch.nn.functional


class _Module(torch.nn.Module):
    is_causal = True


def _reference(q, k, v, mask, causal):
    """SDPA in float64 with the key/value heads repeated (transformers' ``repeat_kv``)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    if mask is None and causal and q.shape[2] > 1:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(k.shape[2] - q.shape[2])
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.double()
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=mask).transpose(1, 2)


def _inputs(b, h, kv, t, length, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, 32, generator=g) * 2
    k = torch.randn(b, kv, length, 32, generator=g) * 2
    v = torch.randn(b, kv, length, 32, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _masks(b, t, length):
    """Every kind the engine makes: none (causal by shape), left padding (bool), a prefix-tree (additive)."""
    pad = torch.ones(b, 1, t, length, dtype=torch.bool).tril(length - t)
    pad[0, ..., :3] = False  # row 0 left-padded by 3
    tree = torch.ones(b, 1, t, length, dtype=torch.bool).tril(length - t)
    tree[..., t // 2 :, 1 : length // 3] = False  # later queries do not see a middle block (another branch)
    additive = torch.zeros(b, 1, t, length).masked_fill(~tree, torch.finfo(torch.float32).min)
    return {"none": None, "padding": pad, "tree": additive}


# a decode step, a full pass, a pass over a cache (transformers leaves out the mask only where the query covers
# every key or is one token, so "none" is not given with a cache)
SHAPES = [(kind, 1, 23) for kind in ("none", "padding", "tree")] + [(kind, 7, 7) for kind in ("none", "padding", "tree")]
SHAPES += [(kind, 5, 19) for kind in ("padding", "tree")]


@pytest.mark.parametrize(("kind", "t", "length"), SHAPES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3)])
def test_matches_sdpa_forward_and_backward_in_float32(kind, heads, kv_heads, t, length):
    from asyncsess_local.attention import grouped_attention

    q, k, v = _inputs(3, heads, kv_heads, t, length, torch.float32)
    mask = _masks(3, t, length)[kind]
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, weights = grouped_attention(_Module(), q, k, v, mask, scaling=32**-0.5)
    ref = _reference(q, k, v, mask, causal=True)
    assert weights is None and out.shape == (3, t, heads, 32) and out.dtype == torch.float32
    assert torch.allclose(out.double(), ref, atol=1e-5)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    want = torch.autograd.grad(ref.sum(), (q, k, v))
    for got, exp in zip(grads, want):
        assert torch.allclose(got.double(), exp.double(), atol=1e-4)


def test_bfloat16_is_as_close_to_float64_as_sdpa():
    """Scores, softmax and the value product run in float32, so bf16 costs only the rounding of in- and output."""
    from asyncsess_local.attention import grouped_attention

    q, k, v = _inputs(16, 9, 3, 1, 63, torch.bfloat16)
    mask = _masks(16, 1, 63)["padding"]
    ref = _reference(q, k, v, mask, causal=True)
    ours = grouped_attention(_Module(), q, k, v, mask)[0]
    sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask).transpose(1, 2)
    err_ours, err_sdpa = (ours.double() - ref).abs().max().item(), (sdpa.double() - ref).abs().max().item()
    assert ours.dtype == torch.bfloat16 and err_ours <= err_sdpa * 1.5 + 1e-3, (err_ours, err_sdpa)


def test_a_query_that_sees_no_key_gets_zeros_as_in_sdpa():
    from asyncsess_local.attention import grouped_attention

    q, k, v = _inputs(2, 2, 2, 3, 3, torch.float32)
    mask = torch.ones(2, 1, 3, 3, dtype=torch.bool)
    mask[1, 0, 0] = False  # a padding query that sees nothing
    out = grouped_attention(_Module(), q, k, v, mask)[0]
    assert torch.isfinite(out).all() and not out[1, 0].any() and out[0, 0].any()


def test_only_a_one_token_query_leaves_sdpa():
    """Prefill and training passes (and what the grouped path does not cover) run SDPA unchanged, bit for bit."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from asyncsess_local.attention import cpu_attention, grouped_attention

    module = _Module()
    module.num_key_value_groups = 3
    for t, length, kw in [(5, 5, {}), (4, 9, {}), (1, 9, {"sliding_window": 2}), (1, 9, {"dropout": 0.5})]:
        q, k, v = _inputs(2, 9, 3, t, length, torch.bfloat16)
        mask = _masks(2, t, length)["padding"]
        torch.manual_seed(0)
        got = cpu_attention(module, q, k, v, mask, **kw)[0]
        torch.manual_seed(0)
        want = sdpa_attention_forward(module, q, k, v, mask, **kw)[0]
        assert torch.equal(got, want), (t, length, kw)
    q, k, v = _inputs(2, 9, 3, 1, 9, torch.bfloat16)
    mask = _masks(2, 1, 9)["padding"]
    assert torch.equal(cpu_attention(module, q, k, v, mask)[0], grouped_attention(module, q, k, v, mask)[0])


def _datum(tokens):
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)}
    )


async def test_local_backend_samples_and_trains_the_same_with_either_attention(tiny, tmp_path):
    """Greedy samples equal, sampled log-probs and losses within float32 rounding of SDPA's (the tiny model, fp32)."""
    from asyncsess import ServiceClient

    results = {}
    for attention in ("grouped", "sdpa"):
        async with ServiceClient(f"local://?device=cpu&dtype=float32&attention={attention}&dir={tmp_path / attention}") as svc:
            tc = await svc.create_lora_training_client(tiny, rank=4, seed=0)
            prompt = tc.get_tokenizer().encode("what is 2 plus")
            group = [prompt + [7 + i, 11, 13 + i] for i in range(4)]  # a shared prefix: the tree mask
            fb = await tc.forward_backward([_datum(x) for x in group], "cross_entropy")
            sc = await tc.save_weights_and_get_sampling_client()
            params = SamplingParams(max_tokens=6, temperature=0.0, stop=[])
            out = await sc.sample(prompt, num_samples=2, sampling_params=params)
            padded = await sc.sample(prompt[:2], num_samples=1, sampling_params=params)  # batched with padding
            results[attention] = (fb.loss, out.sequences[0].tokens, out.sequences[0].logprobs, padded.sequences[0].tokens)
    (loss_g, toks_g, lps_g, pad_g), (loss_s, toks_s, lps_s, pad_s) = results["grouped"], results["sdpa"]
    assert toks_g == toks_s and pad_g == pad_s
    assert math.isclose(loss_g, loss_s, rel_tol=1e-5)
    assert lps_g == pytest.approx(lps_s, abs=1e-4)


def test_an_unknown_attention_is_refused_by_name(backend_factory):
    with pytest.raises(InvalidInputError) as info:
        backend_factory(attention="flash").engine  # noqa: B018 - the engine is built on first use
    assert info.value.field == "attention" and "grouped" in str(info.value)


@pytest.mark.parametrize(
    ("attention", "device", "want"),
    [("auto", "cpu", "asyncsess_grouped"), ("sdpa", "cpu", "sdpa"), ("grouped", "cpu", "asyncsess_grouped")],
)
def test_the_cpu_gets_the_grouped_attention_unless_told_otherwise(tiny, attention, device, want):
    from asyncsess_local import models

    model = models.load_model(models.resolve_model(tiny), torch.device(device), torch.float32, attention)
    assert model.config._attn_implementation == want
