"""Bad input fails before sending, with a typed error naming the field; no sequence number is used."""

import numpy as np
import pytest

from asyncsess import Datum, InvalidInputError, ModelInput, ServiceClient
from asyncsess.validation import MAX_TOPK

from .helpers import rl_datum, sft_datum

pytestmark = pytest.mark.anyio


@pytest.fixture
async def tc():
    async with ServiceClient("mock://") as svc:
        yield await svc.create_lora_training_client("mock/bigram-tiny", rank=4)


def _bad(field_part: str):
    return pytest.raises(InvalidInputError, match=field_part.replace("[", r"\[").replace("]", r"\]"))


async def test_mismatched_shapes(tc):
    d = Datum(model_input=ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]})
    with _bad("data[0].loss_fn_inputs['target_tokens']") as err:
        tc.forward_backward([d], "cross_entropy")
    assert err.value.field == "data[0].loss_fn_inputs['target_tokens']" and "shape" in str(err.value)


async def test_missing_keys_for_the_loss(tc):
    with _bad("data[0].loss_fn_inputs") as err:
        tc.forward_backward([sft_datum([1, 2, 3])], "ppo")
    assert "advantages" in str(err.value) and err.value.fix


async def test_unknown_loss_and_unknown_config(tc):
    with _bad("loss_fn"):
        tc.forward_backward([sft_datum([1, 2, 3])], "dpo")
    with _bad("loss_fn_config['beta']"):
        tc.forward_backward([rl_datum([1, 2, 3], [-1.0, -1.0], 1.0)], "ppo", {"beta": 0.1})


async def test_wrong_dtype(tc):
    d = Datum(
        model_input=ModelInput.from_ints([1, 2]),
        loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]},
    )
    d.loss_fn_inputs["target_tokens"].dtype = "float32"  # type: ignore[misc]
    with _bad("data[0].loss_fn_inputs['target_tokens']") as err:
        tc.forward_backward([d], "cross_entropy")
    assert "int64" in str(err.value)


async def test_empty_prompts(tc):
    with _bad("data"):
        tc.forward_backward([], "cross_entropy")
    with _bad("data[0].model_input"):
        tc.forward_backward([Datum(model_input=ModelInput.empty(), loss_fn_inputs={})], "cross_entropy")
    sc = await tc.save_weights_and_get_sampling_client()
    with _bad("prompt"):
        sc.sample([], 1)


async def test_out_of_range_sampling_params(tc):
    sc = await tc.save_weights_and_get_sampling_client()
    with _bad("sampling_params.temperature"):
        sc.sample([1, 2], 1, {"temperature": -0.5})
    with _bad("num_samples"):
        sc.sample([1, 2], 0)
    with _bad("adam_params.learning_rate"):
        tc.optim_step({"learning_rate": -1})
    with _bad("sampling_params.max_tokens"):  # 2**63 was handed to the backend as it came
        sc.sample([1, 2], 1, {"max_tokens": 2**31})
    with _bad("prompt"):  # a lone surrogate: each tokenizer did something else with it (mock took it)
        sc.sample("caf\ud800", 1)
    assert (await sc.sample("café", 1, {"max_tokens": 2**31 - 1})).sequences


async def test_rejected_op_consumes_no_sequence_number(tc):
    before = tc.current_sequence_number
    for call in (lambda: tc.forward_backward([sft_datum([1])], "ppo"), lambda: tc.optim_step({"beta1": 2})):
        with pytest.raises(InvalidInputError):
            call()
    assert tc.current_sequence_number == before
    out = await tc.forward_backward([sft_datum([1, 2, 3])], "cross_entropy")
    assert tc.current_sequence_number == before + 1 and out.metrics["loss:sum"] > 0


async def test_backend_rejects_out_of_vocab_tokens_with_a_typed_error(tc):
    with pytest.raises(InvalidInputError):
        await tc.forward_backward([sft_datum([1, 2, 10**6])], "cross_entropy")


async def test_unknown_scheme_names_the_fix():
    with pytest.raises(InvalidInputError, match="no backend for scheme 'nope'"):
        async with ServiceClient("nope://x"):
            pass


@pytest.mark.parametrize(
    ("url", "field"),
    [
        (5, "url"),  # AttributeError from urlsplit
        ("mock://h:abc", "url"),  # ValueError from urlsplit's port
        ("mock://h:99999", "url"),
        ("http://", "url"),  # retried against no host until the op's deadline
        ("mock://?latency_ms=nan", "url ?latency_ms="),  # ValueError from anyio's sleep at the first call
        ("mock://?latency_ms=inf", "url ?latency_ms="),  # every call slept forever
    ],
)
async def test_a_url_that_cannot_name_a_backend_is_refused_naming_it(url, field):
    with pytest.raises(InvalidInputError) as err:
        async with ServiceClient(url):
            pass
    assert err.value.field == field and err.value.fix


@pytest.mark.parametrize("option", [{"latency_ms": float("nan")}, {"slow_ms": float("inf")}, {"jitter_ms": float("nan")}])
async def test_a_mock_option_given_by_keyword_is_checked_as_the_url_is(option):
    """A keyword option skipped the URL's check: latency_ms=NaN failed the first call with anyio's ValueError."""
    with pytest.raises(InvalidInputError) as err:
        async with ServiceClient("mock://", **option):
            pass
    assert err.value.field == f"url ?{next(iter(option))}="


async def test_url_defaults_to_the_environment_then_local(monkeypatch):
    monkeypatch.setenv("ASYNCSESS_URL", "mock://?latency_ms=1")
    assert ServiceClient().url == "mock://?latency_ms=1"
    monkeypatch.delenv("ASYNCSESS_URL")
    assert ServiceClient().url == "local://"


async def test_per_token_clip_bounds_pass_the_client_and_are_checked():
    """ppo / cispo / gspo take per-token clip bounds; like the config's, low must be in [0, 1] and high ≥ 1 (a low
    bound of 1e308 above a high one of 1.2 was taken: the bounds crossed)."""
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        base = {"target_tokens": [2, 3, 4], "logprobs": [-1.0, -2.0, -1.5], "advantages": [1.0, -1.0, 0.5]}
        ok = Datum(
            model_input=ModelInput.from_ints([1, 2, 3]),
            # bounds exact in float32, the dtype the Tinker wire gives per-token inputs (this test also runs over it)
            loss_fn_inputs={**base, "clip_low_threshold": [0.75] * 3, "clip_high_threshold": [1.25] * 3},
        )
        by_tokens = await tc.forward(ok, "ppo")
        by_config = await tc.forward(
            Datum(model_input=ok.model_input, loss_fn_inputs=base), "ppo", {"clip_low_threshold": 0.75, "clip_high_threshold": 1.25}
        )
        assert by_tokens.metrics["loss:sum"] == by_config.metrics["loss:sum"]
        for key, bad in [
            ("clip_low_threshold", [0.8, -0.1, 0.8]),
            ("clip_low_threshold", [0.8, 1e308, 0.8]),
            ("clip_high_threshold", [1.2, 1.2, 0.9]),
        ]:
            d = Datum(model_input=ok.model_input, loss_fn_inputs={**base, key: bad})
            with pytest.raises(InvalidInputError) as err:
                tc.forward_backward(d, "ppo")
            assert err.value.field == f"data[0].loss_fn_inputs[{key!r}]"
        with pytest.raises(InvalidInputError, match="does not use"):  # dro has no clip
            tc.forward_backward(Datum(model_input=ok.model_input, loss_fn_inputs={**base, "clip_low_threshold": [0.8] * 3}), "dro")


@pytest.mark.parametrize("bad", [-1, 2**63, 2**64, -(2**63) - 1, 10**400])
async def test_prompt_ids_outside_int64_are_refused_before_sending(tc, bad):
    """A prompt id past int64 once reached the backend as an OverflowError; it is refused like a datum's."""
    sc = await tc.save_weights_and_get_sampling_client()
    for call in (lambda: sc.sample([1, bad], 1, {"max_tokens": 2}), lambda: sc.compute_logprobs([1, bad])):
        with pytest.raises(InvalidInputError) as err:
            call()
        assert err.value.field == "prompt" and "not a token id" in str(err.value) and err.value.fix
    assert len((await sc.sample([1, 2], 1, {"max_tokens": 2})).sequences) == 1


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda tc, sc: tc.optim_step({"learning_rate": True}), "adam_params.learning_rate"),  # was read as lr = 1.0
        (lambda tc, sc: tc.optim_step({"beta1": False}), "adam_params.beta1"),
        (lambda tc, sc: sc.sample([1, 2], 1, {"max_tokens": True}), "sampling_params.max_tokens"),
        (lambda tc, sc: sc.sample([1, 2], 1, {"seed": True}), "sampling_params.seed"),
        (lambda tc, sc: sc.sample([1, 2], 1, {"temperature": False}), "sampling_params.temperature"),
    ],
)
async def test_a_bool_where_a_number_goes_is_refused_not_read_as_1_or_0(tc, call, field):
    sc = await tc.save_weights_and_get_sampling_client()
    before = tc.current_sequence_number
    with pytest.raises(InvalidInputError) as err:
        call(tc, sc)
    assert err.value.field == field and "bool" in str(err.value)
    assert tc.current_sequence_number == before
    assert (await tc.optim_step({"learning_rate": 1})).metrics["learning_rate"] == 1.0  # an int is still a number


@pytest.mark.parametrize(
    "prompt",
    [[1, True], (False, 2), {"chunks": [{"type": "encoded_text", "tokens": [1, True]}]}],
    ids=["list", "tuple", "model-input-json"],
)
async def test_a_bool_in_a_prompt_is_refused_not_read_as_token_1(tc, prompt):
    """JSON ``true`` among the token ids (the Tinker wire's ``prompt.chunks[].tokens``) was read as id 1."""
    sc = await tc.save_weights_and_get_sampling_client()
    for call in (lambda: sc.sample(prompt, 1, {"max_tokens": 2}), lambda: sc.compute_logprobs(prompt)):
        with pytest.raises(InvalidInputError) as err:
            call()
        assert err.value.field == "prompt" and "bool" in str(err.value)


@pytest.mark.parametrize("loss_fn", [["cross_entropy"], {"name": "ppo"}, 3, None, np.array(["ppo", "dro"])])
async def test_a_loss_that_is_not_a_name_is_a_typed_error(tc, loss_fn):
    """A list or dict as loss_fn raised TypeError (unhashable type) from the loss table, not InvalidInputError; a numpy
    array of names, ValueError ('truth value of an array ... is ambiguous')."""
    with _bad("loss_fn"):
        tc.forward_backward([sft_datum([1, 40, 41])], loss_fn)
    assert tc.forward_backward([sft_datum([1, 40, 41])], "cross_entropy").seq == 1


async def test_a_uint64_array_past_int64_is_refused_by_its_value_not_wrapped():
    """numpy's cast to int64 wrapped 2**64-1 to -1, so the refusal named an id nobody sent."""
    import numpy as np

    from asyncsess import TensorData

    wrapped = TensorData.from_numpy(np.array([1, 2**64 - 1], dtype=np.uint64))
    assert wrapped.data == [1, 2**64 - 1] and wrapped.dtype == "int64"
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("m", rank=4)
        d = Datum(model_input=[1, 2], loss_fn_inputs={"target_tokens": np.array([3, 2**64 - 1], dtype=np.uint64), "weights": [1.0, 1.0]})
        with pytest.raises(InvalidInputError, match="id 18446744073709551615 is not a token id"):
            tc.forward_backward([d], "cross_entropy")
        assert tc.current_sequence_number == 0


async def test_torch_forms_of_a_datum_are_taken_or_refused_typed_before_numbering(tc):
    """A datum built from torch tensors: bfloat16 / requires_grad / non-contiguous are taken as their values; a meta
    tensor (no values) raised NotImplementedError from deep inside torch, a bool tensor was read as 1.0 and 0.0."""
    torch = pytest.importorskip("torch")
    ids = torch.arange(40, 46).reshape(3, 2)[:, 0]  # non-contiguous: 40, 42, 44
    weights = torch.ones(2, 3, dtype=torch.bfloat16, requires_grad=True).t()[:, 0]
    good = {"model_input": ids, "loss_fn_inputs": {"target_tokens": ids + 1, "weights": weights}}
    out = await tc.forward_backward([good], "cross_entropy")
    assert len(out.loss_fn_outputs[0]["logprobs"].data) == 3 and tc.current_sequence_number == 1
    bad = [
        ({**good, "model_input": ids.to("meta")}, "data[0]"),
        ({**good, "loss_fn_inputs": {"target_tokens": ids + 1, "weights": torch.ones(3, device="meta")}}, "['weights']"),
        ({**good, "loss_fn_inputs": {"target_tokens": ids + 1, "weights": torch.ones(3, dtype=torch.bool)}}, "['weights']"),
        ({**good, "loss_fn_inputs": {"target_tokens": (ids + 1).to(torch.complex64), "weights": weights}}, "['target_tokens']"),
    ]
    for datum, field in bad:
        with pytest.raises(InvalidInputError) as err:
            tc.forward_backward([datum], "cross_entropy")
        assert field in err.value.field and err.value.fix
    assert tc.current_sequence_number == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_samples_in_flight", 0),  # the pool admitted nothing: every sample() waited forever
        ("max_samples_in_flight", -1),
        ("max_samples_in_flight", "8"),  # a TypeError at the first sample()
        ("max_sample_bytes", 0),
        ("max_chunk_datums", True),
        ("max_chunk_bytes", 2.5),
        ("heartbeat_interval", float("nan")),  # NaN > 0 is False: the heartbeat was silently off
        ("heartbeat_interval", -1.0),
        ("heartbeat_interval", "10"),  # a TypeError when the client opened
        ("heartbeat_interval", 1e-9),  # a heartbeat loop that never slept: every session touched without end
        ("heartbeat_interval", 5e-324),
    ],
)
async def test_a_client_bound_out_of_range_is_refused_when_the_client_is_made(field, value):
    with pytest.raises(InvalidInputError) as err:
        ServiceClient("mock://", **{field: value})
    assert err.value.field == field and err.value.fix


async def test_client_bounds_in_range_are_taken():
    import numpy as np

    async with ServiceClient("mock://", max_samples_in_flight=np.int64(1), max_chunk_datums=1, heartbeat_interval=float("inf")) as svc:
        sc = await svc.create_sampling_client(base_model="m")
        assert len((await sc.sample([1, 2], 2, {"max_tokens": 2})).sequences) == 2
        assert svc._limiter.max_in_flight == 1 and svc._heartbeat_interval == 0.0  # inf: no heartbeat, as 0


class _ImageChunk:
    """Tinker's ``ImageChunk``: a chunk with no token ids."""

    type = "image"
    data = b"\x89PNG"
    expected_tokens = 4


class _ForeignModelInput:
    """Another library's ``ModelInput`` (Tinker's), read by its ``chunks``."""

    def __init__(self, *chunks: object) -> None:
        self.chunks = list(chunks)


@pytest.mark.parametrize(
    "prompt",
    [
        _ForeignModelInput(ModelInput.from_ints([1, 40]).chunks[0], _ImageChunk()),
        {"chunks": [{"type": "encoded_text", "tokens": [1, 40]}, {"type": "image", "data": "iVBO", "format": "png"}]},
    ],
    ids=["tinker-object", "json"],
)
async def test_an_image_chunk_is_refused_by_name_before_numbering(tc, prompt):
    """Tinker's ModelInput with an image chunk raised AttributeError ('no attribute tokens') from sample and
    forward_backward; its JSON form was refused as a missing 'tokens' field."""
    sc = await tc.save_weights_and_get_sampling_client()
    before = tc.current_sequence_number
    datum = {"model_input": prompt, "loss_fn_inputs": {"target_tokens": [40, 41, 42], "weights": [1.0] * 3}}
    for call, field in [
        (lambda: sc.sample(prompt, 1, {"max_tokens": 2}), "prompt"),
        (lambda: sc.compute_logprobs(prompt), "prompt"),
        (lambda: tc.forward_backward([datum], "cross_entropy"), "data[0]"),
    ]:
        with pytest.raises(InvalidInputError) as err:
            call()
        assert err.value.field == field and "chunks[1] has type 'image'" in str(err.value)
    assert tc.current_sequence_number == before


async def test_a_tensor_whose_data_does_not_fill_its_shape_is_refused_before_numbering(tc):
    """The client compared a tensor's shape with the input, not with its data: a tensor edited after it was checked
    (or built with model_construct) reached the backend, which refused it once numbered, poisoning every later op."""
    d = Datum(model_input=ModelInput.from_ints([1, 40]), loss_fn_inputs={"target_tokens": [40, 41], "weights": [1.0, 1.0]})
    d.loss_fn_inputs["weights"].data.append(1.0)
    with _bad("data[0].loss_fn_inputs['weights']") as err:
        tc.forward_backward([d], "cross_entropy")
    assert "shape [2] holds 2 values but data has 3" in str(err.value)
    d.loss_fn_inputs["weights"].data.pop()
    d.loss_fn_inputs["target_tokens"].data[0] = 40.5  # was truncated to token 40 and trained on
    with _bad("data[0].loss_fn_inputs['target_tokens']") as err:
        tc.forward_backward([d], "cross_entropy")
    assert "id 40.5 is not a token id" in str(err.value)
    assert tc.current_sequence_number == 0
    assert (await tc.forward_backward([sft_datum([1, 40, 41])], "cross_entropy")).metrics["loss:sum"] > 0


@pytest.mark.parametrize("field", ["train_mlp", "train_attn", "train_unembed"])
async def test_a_train_flag_that_is_not_a_bool_is_refused_naming_it(field):
    """train_mlp="false" was taken as truthy on mock:// and local:// (an http:// worker refused it: one rule now)."""
    async with ServiceClient("mock://") as svc:
        for value in ("false", 0, 1.0):
            with pytest.raises(InvalidInputError) as err:
                await svc.create_lora_training_client("m", rank=4, **{field: value})
            assert err.value.field == field
        tc = await svc.create_lora_training_client("m", rank=4, **{field: None})  # SageMaker's None: the default
        assert tc.get_info().lora_rank == 4


async def test_a_training_clients_sampler_refuses_both_spellings_of_its_path(tc):
    """Given model_path and model_package_arn, the training client's create_sampling_client used the first and dropped
    the other without a word (the ServiceClient's refused it)."""
    saved = (await tc.save_weights_for_sampler("w")).path
    with _bad("model_package_arn"):
        await tc.create_sampling_client(saved, model_package_arn="arn:aws:sagemaker:us-west-2:1:model-package/x/1")
    assert (await tc.create_sampling_client(model_package_arn=saved)).model_package_arn == saved


async def test_numpy_counts_are_counts_and_a_float_count_is_not_called_out_of_range(tc, monkeypatch):
    """num_samples=np.int64(2) was refused as 'np.int64(2) is out of range' (pydantic's own fields take numpy ints);
    it reaches the backend as a plain int (JSON has no numpy ints)."""
    sc = await tc.save_weights_and_get_sampling_client()
    backend, seen = sc._svc.backend, []
    real = backend.sample

    async def spy(sampler_id, request):
        seen.append((type(request.num_samples), type(request.topk_sample_logprobs)))
        return await real(sampler_id, request)

    monkeypatch.setattr(backend, "sample", spy)
    out = await sc.sample([1, 2], np.int64(2), {"max_tokens": 2}, topk_sample_logprobs=np.int32(1))
    assert len(out.sequences) == 2 and len(out.sequences[0].topk_logprobs[0]) == 1 and seen == [(int, int)]
    with _bad("num_samples") as err:
        sc.sample([1, 2], 2.0)
    assert "not a whole number" in str(err.value)


async def test_a_target_prompt_logprobs_id_past_float_range_is_refused_typed(tc):
    """An id of 10**400 among floats in target_prompt_logprobs raised OverflowError (int too large to convert to float)."""
    sc = await tc.save_weights_and_get_sampling_client()
    with _bad("target_prompt_logprobs"):
        sc.sample([1, 2, 3], 1, {"max_tokens": 2}, target_prompt_logprobs=[0.5, 10**400])
    assert len((await sc.sample([1, 2, 3], 1, {"max_tokens": 2}, target_prompt_logprobs=[[1, 2], [3, -1]])).sequences) == 1


async def test_target_prompt_logprobs_past_1024_per_position_are_refused_before_their_cells_are_read(tc):
    """K had no bound in the core check (the worker's bodies had 1,024): a [1, 6_000_000] target on asyncsess serve
    was read cell by cell on the event loop (7 s that every key waited), then sampled. Now K > 1,024, in any
    form (nested rows, flat data with a shape, a CSR shape that would densify), is refused by name."""
    sc = await tc.save_weights_and_get_sampling_client()
    wide = MAX_TOPK + 1
    for target in (
        [[1] * wide],
        {"data": [1] * wide, "dtype": "int64", "shape": [1, wide]},
        {"data": [1], "dtype": "int64", "shape": [1, 2**26], "sparse_crow_indices": [0, 1], "sparse_col_indices": [0]},
    ):
        with _bad("target_prompt_logprobs") as err:
            sc.sample([1, 2], 1, {"max_tokens": 1}, target_prompt_logprobs=target)
        assert f"K <= {MAX_TOPK}" in str(err.value)
    got = await sc.sample([1, 2], 1, {"max_tokens": 1}, target_prompt_logprobs=[[1] * MAX_TOPK])
    assert got.target_prompt_logprobs.shape == [1, MAX_TOPK]
