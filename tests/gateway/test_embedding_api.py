"""Tests of skippy_zmq.gateway.embedding_api: /v1/embeddings bodies, the per-input checks, the answer."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types import CreateEmbeddingResponse

from skippy_zmq.gateway.embedding_api import MAX_EMBEDDING_INPUTS, EmbeddingParams
from skippy_zmq.gateway.openai_api import ApiError
from skippy_zmq.tokens.pooling import Pooling
from tests.strategies import hostile_json


def refused(body: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        EmbeddingParams.from_body(body)
    assert (info.value.status, info.value.type) == (400, "invalid_request_error")
    return info.value


@pytest.mark.parametrize(("given", "inputs"), [
    ("hello", ("hello",)),
    (["a", "b"], ("a", "b")),
    ([1, 2, 3], ((1, 2, 3),)),
    ([[1, 2], [3]], ((1, 2), (3,))),
    (["a", [4]], ("a", (4,))),
])
def test_input_forms(given: Any, inputs: tuple[Any, ...]) -> None:
    assert EmbeddingParams.from_body({"input": given}).inputs == inputs


def test_defaults_and_fields() -> None:
    params = EmbeddingParams.from_body({"input": "x"})
    assert (params.model, params.encoding_format, params.dimensions) == (None, "float", None)
    params = EmbeddingParams.from_body({"input": "x", "model": "m", "encoding_format": "base64", "dimensions": 640,
                                        "user": "u"})
    assert (params.model, params.encoding_format, params.dimensions) == ("m", "base64", 640)
    assert EmbeddingParams.from_body({"input": "x", "dimensions": None, "model": None}) == EmbeddingParams(("x",))


@pytest.mark.parametrize(("body", "param"), [
    ({}, "input"), ({"input": None}, "input"), ({"input": ""}, "input"), ({"input": []}, "input"),
    ({"input": 5}, "input"), ({"input": {"text": "x"}}, "input"), ({"input": ["a", ""]}, "input[1]"),
    ({"input": [[1], []]}, "input[1]"), ({"input": [[1], [-1]]}, "input[1]"), ({"input": [1, -2]}, "input"),
    ({"input": [True]}, "input[0]"), ({"input": [[1.5]]}, "input[0]"), ({"input": [2**31]}, "input"),
    ({"input": ["a", 1]}, "input[1]"), ({"input": [None]}, "input[0]"),
    ({"input": ["x"] * (MAX_EMBEDDING_INPUTS + 1)}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"), ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": "8"}, "dimensions"), ({"input": "x", "model": 3}, "model"),
    ({"input": "x", "user": 3}, "user"), ({"input": "x", "prompt": "y"}, "prompt"), ([], None),
])
def test_bad_bodies_are_a_400_naming_the_field(body: Any, param: str | None) -> None:
    assert refused(body).param == param


def test_the_input_limit_is_openais() -> None:
    assert len(EmbeddingParams.from_body({"input": ["x"] * MAX_EMBEDDING_INPUTS}).inputs) == 2048
    assert "at most 2048" in refused({"input": ["x"] * 2049}).message


def test_dimensions_only_at_the_models_width() -> None:
    EmbeddingParams(("x",)).check_dimensions(640)
    EmbeddingParams(("x",), dimensions=640).check_dimensions(640)
    with pytest.raises(ApiError) as info:
        EmbeddingParams(("x",), dimensions=256).check_dimensions(640)
    assert info.value.param == "dimensions" and "640 dimensions (n_embd)" in info.value.message
    with pytest.raises(ApiError):
        EmbeddingParams(("x",), dimensions=256).check_dimensions(None)


def test_requests_one_per_input() -> None:
    params = EmbeddingParams(("ab", (5, 6)))
    requests = params.requests([[2, 7, 8], [5, 6]], 16, n_vocab=10, pooling=Pooling.LAST)
    assert [(r.prompt, r.prompt_ids, r.embedding, r.max_tokens) for r in requests] == [
        ("ab", (2, 7, 8), Pooling.LAST, 0), ("", (5, 6), Pooling.LAST, 0)]


@pytest.mark.parametrize(("ids", "param", "code"), [
    ([[1], [1] * 16], "input[1]", "context_length_exceeded"),
    ([[1], [10]], "input[1]", None),
    ([[1], []], "input[1]", None),
])
def test_requests_check_each_input(ids: list[list[int]], param: str, code: str | None) -> None:
    with pytest.raises(ApiError) as info:
        EmbeddingParams(("a", "b")).requests(ids, 16, n_vocab=10, pooling=Pooling.MEAN)
    assert (info.value.status, info.value.param, info.value.code) == (400, param, code)


def test_a_single_input_is_named_input() -> None:
    with pytest.raises(ApiError) as info:
        EmbeddingParams(("a",)).requests([[1] * 16], 16, n_vocab=10, pooling=Pooling.MEAN)
    assert info.value.param == "input"
    assert EmbeddingParams(("a",)).requests([[1] * 15], 16, n_vocab=10, pooling=Pooling.MEAN)[0].prompt_ids


def test_response_float_and_base64() -> None:
    vectors = [np.array([0.6, 0.8], dtype=np.float32), np.array([1.0, -0.0], dtype=np.float32)]
    body = EmbeddingParams(("a", "b")).response(vectors, "tiny", 7)
    parsed = CreateEmbeddingResponse.model_validate(body)
    assert [item.embedding for item in parsed.data] == [[float(np.float32(0.6)), float(np.float32(0.8))],
                                                          [1.0, -0.0]]
    assert (parsed.usage.prompt_tokens, parsed.usage.total_tokens, parsed.model) == (7, 7, "tiny")
    encoded = EmbeddingParams(("a", "b"), encoding_format="base64").response(vectors, "tiny", 7)
    raw = base64.b64decode(encoded["data"][0]["embedding"])
    assert raw == np.array([0.6, 0.8], dtype="<f4").tobytes()  # little-endian float32, as OpenAI's client reads


@given(hostile_json(["input", "model", "encoding_format", "dimensions", "user"]))
@settings(max_examples=300, deadline=None)
def test_any_hostile_body_gives_params_or_a_400(data: bytes) -> None:
    try:
        params = EmbeddingParams.from_json(data)
    except ApiError as error:
        assert error.status == 400
        return
    assert 1 <= len(params.inputs) <= MAX_EMBEDDING_INPUTS


@given(st.lists(st.integers(-3, 2**31) | st.text(max_size=3) | st.lists(st.integers(-1, 20), max_size=3),
                max_size=4))
@settings(max_examples=300, deadline=None)
def test_any_input_list_gives_inputs_or_a_400_naming_input(value: list[Any]) -> None:
    try:
        params = EmbeddingParams.from_body({"input": value})
    except ApiError as error:
        assert error.param is not None and error.param.startswith("input")
        return
    assert all(isinstance(item, (str, tuple)) and len(item) > 0 for item in params.inputs)
