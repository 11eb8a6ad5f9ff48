import pickle

import numpy as np
import pytest
from pydantic import ValidationError

from asyncsess import AdamParams, CheckpointResponse, Datum, InvalidInputError, ModelInput, SamplingParams, TensorData


def test_model_input_round_trip_and_forms():
    mi = ModelInput.from_ints([1, 2, 3])
    assert mi.to_ints() == [1, 2, 3] and mi.length == 3
    assert ModelInput.from_any([4, 5]).to_ints() == [4, 5]
    assert ModelInput.from_any({"prompt": [7]}).to_ints() == [7]
    assert ModelInput.from_any({"chunks": [{"tokens": [1], "type": "encoded_text"}, {"tokens": [2, 3]}]}).to_ints() == [1, 2, 3]
    assert mi.append_int(9).to_ints() == [1, 2, 3, 9]
    assert ModelInput.from_any(np.array([3, 4])).to_ints() == [3, 4]
    with pytest.raises(TypeError):
        ModelInput.from_any([1.5])


def test_a_tokenizers_output_is_a_prompt_and_a_batch_is_refused_by_name():
    """transformers 5's ``apply_chat_template`` returns a BatchEncoding (a mapping with ``input_ids``)."""
    from collections import UserDict

    assert ModelInput.from_any(UserDict({"input_ids": [5, 6], "attention_mask": [1, 1]})).to_ints() == [5, 6]
    assert ModelInput.from_any({"input_ids": np.array([7, 8])}).to_ints() == [7, 8]
    assert ModelInput.from_any((np.int64(3), 4)).to_ints() == [3, 4]  # a tuple of integer-likes is one prompt
    with pytest.raises(TypeError, match=r"batch of 1 token lists.*input_ids\[0\]"):
        ModelInput.from_any({"input_ids": np.array([[7, 8]])})
    with pytest.raises(TypeError, match="must hold token ids"):
        ModelInput.from_any({"input_ids": ["a"]})


def test_tensor_data_coercion_by_key():
    assert TensorData.coerce("target_tokens", [1.0, 2.0]).dtype == "int64"
    assert TensorData.coerce("weights", [1, 0]).dtype == "float32"
    t = TensorData.coerce("advantages", np.array([0.5, 1.5], dtype=np.float64))
    assert t.dtype == "float32" and t.shape == [2] and t.data == [0.5, 1.5]
    assert TensorData.from_numpy(np.zeros((2, 3))).shape == [2, 3]
    assert TensorData.coerce("weights", [1, 2]).to_numpy().dtype == np.float32
    with pytest.raises(ValidationError):
        TensorData(data=[1, 2, 3], dtype="int64", shape=[2])


@pytest.mark.parametrize(
    "targets",
    [[1.5, 2], np.array([1.5, 2.0]), np.array([np.nan, 2.0]), ["1", 2], [True, 2], {"data": [1.5, 2], "dtype": "int64"}],
)
def test_token_ids_are_whole_numbers_never_truncated_or_parsed(targets):
    """``target_tokens`` of 1.5 trained on token 1, "1" and True were read as 1; whole floats (1.0) still pass."""
    with pytest.raises(ValueError, match="target_tokens"):
        Datum(model_input=[1, 2], loss_fn_inputs={"target_tokens": targets, "weights": [1.0, 1.0]})
    ok = Datum(model_input=[1, 2], loss_fn_inputs={"target_tokens": np.array([1.0, 2.0]), "weights": [1, 0.0]})
    assert ok.loss_fn_inputs["target_tokens"].data == [1, 2] and ok.loss_fn_inputs["weights"].data == [1.0, 0.0]


def test_datum_accepts_both_anchor_forms():
    d = Datum.model_validate({"prompt": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 3], "weights": [1, 1]}})
    assert d.model_input.to_ints() == [1, 2]
    assert d.loss_fn_inputs["target_tokens"].dtype == "int64"
    d2 = Datum(model_input=[1, 2], loss_fn_inputs={"weights": np.ones(2)})
    assert d2.loss_fn_inputs["weights"].data == [1.0, 1.0]


def test_params_validate_ranges_and_accept_sagemaker_nones():
    with pytest.raises(ValidationError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValidationError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValidationError, match="top_k"):
        SamplingParams(top_k=0)
    with pytest.raises(ValidationError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    sp = SamplingParams(temperature=None, top_p=None, top_k=None, stop=["\n", 5])
    assert (sp.temperature, sp.top_p, sp.top_k) == (1.0, 1.0, -1)
    assert sp.stop_strings() == ["\n"] and sp.stop_token_ids() == [5]
    assert SamplingParams(stop="x").stop_strings() == ["x"]
    assert AdamParams(grad_clip_norm=None).grad_clip_norm == 0.0
    with pytest.raises(ValidationError, match="beta2"):
        AdamParams(beta2=1.0)


def test_checkpoint_response_speaks_both_names():
    r = CheckpointResponse(path="mock://s/weights/a")
    assert r.model_package_arn == r.path


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: AdamParams(learning_rate=-1), "learning_rate"),
        (lambda: AdamParams(eps=float("nan")), "eps"),
        (lambda: AdamParams(lr=1e-3), "lr"),
        (lambda: SamplingParams(temperature=-1), "temperature"),
        (lambda: TensorData(data=[1, 2, 3], dtype="int64", shape=[2]), None),
    ],
)
def test_a_refused_input_value_is_a_bad_request_naming_the_field(build, field):
    """AdamParams(learning_rate=-1) raised pydantic's bare ValidationError, which a loop ported from Tinker does not
    catch with `except tinker.BadRequestError` (the SDK refuses it as a 400). Now it is an InvalidInputError naming
    the field (BadRequestError, the error every other check raises), still a ValidationError, and it pickles."""
    import asyncsess.sync as tinker

    with pytest.raises(tinker.BadRequestError) as err:
        build()
    assert isinstance(err.value, ValidationError) and isinstance(err.value, InvalidInputError)
    assert err.value.field == field  # a check of the whole object (the shape against the data) names none
    assert err.value.status_code == 400 and err.value.category == "user" and err.value.errors()
    again = pickle.loads(pickle.dumps(err.value))
    assert type(again) is type(err.value) and str(again) == str(err.value) and again.field == err.value.field


@pytest.mark.parametrize(
    "build",
    [
        lambda: AdamParams(learning_rate="0.001"),
        lambda: AdamParams(weight_decay=b"0"),
        lambda: SamplingParams(max_tokens="5"),
        lambda: TensorData(data=["1", 2.0], dtype="float32"),
        lambda: TensorData(data=[1.0, True], dtype="float32"),
        lambda: TensorData(data=[1.0, 2.0], dtype="float32", shape=["2"]),
        lambda: ModelInput(chunks=[{"tokens": [1, "2"]}]),
        lambda: Datum(model_input=[1, 2], loss_fn_inputs={"weights": [1.0, "1"]}),
    ],
    ids=["adam-str", "adam-bytes", "max-tokens-str", "data-str", "data-bool", "shape-str", "tokens-str", "datum-weights-str"],
)
def test_text_and_bools_are_not_numbers(build):
    """pydantic's lax mode read "0.001" as 0.001 and True as 1: a loop passing the wrong column trained on it."""
    with pytest.raises(InvalidInputError, match="not a number|token id is an int"):
        build()


@pytest.mark.parametrize(
    "value",
    [[True, "1"], ("1", "2"), [[1.0], ["1"]], np.array(["1", "2"]), np.array([True, False]), np.array([1 + 2j]), np.array([1, None])],
    ids=["list-bool-str", "tuple-str", "rows-str", "np-str", "np-bool", "np-complex", "np-object"],
)
def test_tensor_coercion_takes_numbers_only(value):
    with pytest.raises(TypeError, match="not (a number|numbers)"):
        TensorData.coerce("weights", value)


def test_numeric_numpy_and_torch_forms_stay_accepted():
    torch = pytest.importorskip("torch")
    assert AdamParams(learning_rate=np.float32(0.5), beta1=np.float64(0.5)).learning_rate == 0.5
    assert TensorData.coerce("weights", [np.float32(0.5), np.int64(2), 1, 1.5]).data == [0.5, 2.0, 1.0, 1.5]
    assert TensorData.coerce("target_tokens", np.array([3, 4], dtype=np.uint16)).data == [3, 4]
    base = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).requires_grad_()
    t = TensorData.coerce("weights", base.t())  # bfloat16, requires_grad, non-contiguous
    assert t.shape == [3, 2] and t.data == [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]
    assert TensorData.coerce("weights", torch.tensor([0.0, 2.0]).to_sparse()).data == [0.0, 2.0]
    for bad in (torch.ones(2, device="meta"), torch.ones(2, dtype=torch.bool), torch.ones(2, dtype=torch.complex64)):
        with pytest.raises(TypeError):
            TensorData.coerce("weights", bad)
