"""`POST /v1/embeddings` bodies and answers in OpenAI's shapes; socket-free (docs/PROTOCOL.md §9.2, §9.3).

`EmbeddingParams.from_json` validates a body into one frozen value; `EmbeddingParams.requests`
checks each tokenized input against the vocabulary and the context and builds one engine
`GenerationRequest` per input (no tokens generated: the final stage pools its output-normed rows);
`EmbeddingParams.response` answers with the vectors, as floats or as OpenAI's base64 of
little-endian float32 bytes.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.driver.generation import GenerationRequest
from skippy_zmq.gateway.openai_api import (
    IGNORED_LOG,
    ApiError,
    JsonObject,
    checked_body,
    is_int,
    known_fields,
    shown_value,
)
from skippy_zmq.gateway.request_json import OversizedInteger
from skippy_zmq.tokens.pooling import Pooling
from skippy_zmq.wire.replies import MAX_EMBEDDING_VALUES

MAX_EMBEDDING_INPUTS = 2048
"""Inputs per request: OpenAI's limit."""
ENCODING_FORMATS = ("float", "base64")
"""`encoding_format` values: a list of floats, or base64 of the little-endian float32 bytes."""
_MAX_TOKEN_ID = 2**31 - 1
_FIELDS = frozenset({"input", "model", "encoding_format", "dimensions", "user"})

EmbeddingInput: TypeAlias = str | tuple[int, ...]
"""One input: text, or token ids."""


def _token_ids(value: list[Any], name: str) -> tuple[int, ...]:
    if not value:
        raise ApiError.invalid(name, f"{name} is an empty list of token ids; give at least one")
    bad = next((item for item in value if not is_int(item) or not 0 <= item <= _MAX_TOKEN_ID), None)
    if bad is not None:
        raise ApiError.invalid(name, f"{name} holds {shown_value(bad)}; token ids are integers in "
                               f"[0, {_MAX_TOKEN_ID}]")
    return tuple(value)


def _text(value: str, name: str) -> str:
    if not value:
        raise ApiError.invalid(name, f"{name} is an empty string; there is nothing to embed")
    return value


def _inputs(value: Any) -> tuple[EmbeddingInput, ...]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
    if isinstance(value, str):
        return (_text(value, "input"),)
    if not isinstance(value, list) or not value:
        raise ApiError.invalid("input", "input must be a string, a non-empty list of strings, a list of token ids "
                               "or a list of lists of token ids")
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise ApiError.invalid("input", f"input holds {len(value)} inputs; at most {MAX_EMBEDDING_INPUTS} are "
                               "accepted per request")
    if all(is_int(item) or isinstance(item, OversizedInteger) for item in value):
        return (_token_ids(value, "input"),)
    inputs: list[EmbeddingInput] = []
    for index, item in enumerate(value):
        name = f"input[{index}]"
        if isinstance(item, str):
            inputs.append(_text(item, name))
        elif isinstance(item, list):
            inputs.append(_token_ids(item, name))
        else:
            raise ApiError.invalid(name, f"{name} must be a string or a list of token ids, got {shown_value(item)}")
    return tuple(inputs)


@attrs.frozen
class EmbeddingParams:
    """A validated embeddings request."""

    inputs: tuple[EmbeddingInput, ...]
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None

    @classmethod
    def from_json(cls, data: bytes) -> EmbeddingParams:
        """Validate a body as received (UTF-8 JSON, valid text); ApiError 400 naming the field."""
        return cls.from_body(checked_body(data))

    @classmethod
    def from_body(cls, body: Any) -> EmbeddingParams:
        """Validate a parsed body; ApiError 400 naming the first bad field (`null` = absent)."""
        fields = known_fields(body, _FIELDS, "/v1/embeddings")
        if "input" not in fields:
            raise ApiError.invalid("input", "input is required")
        for name in ("model", "user"):
            if name in fields and not isinstance(fields[name], str):
                raise ApiError.invalid(name, f"{name} must be a string, got {shown_value(fields[name])}")
        if "user" in fields:
            IGNORED_LOG.note("user")
        encoding = fields.get("encoding_format", "float")
        if encoding not in ENCODING_FORMATS:
            raise ApiError.invalid("encoding_format", f"encoding_format must be \"float\" or \"base64\", got "
                                   f"{shown_value(encoding)}")
        dimensions = fields.get("dimensions")
        if dimensions is not None and (not is_int(dimensions) or dimensions < 1):
            raise ApiError.invalid("dimensions", f"dimensions must be an integer >= 1, got "
                                   f"{shown_value(dimensions)}")
        return cls(_inputs(fields["input"]), fields.get("model"), encoding, dimensions)

    def check_dimensions(self, n_embd: int | None) -> None:
        """400 naming `dimensions` unless it is absent or the model's width (vectors are never cut)."""
        if self.dimensions is None or self.dimensions == n_embd:
            return
        width = "an unknown width" if n_embd is None else f"{n_embd} dimensions (n_embd)"
        raise ApiError.invalid("dimensions", f"dimensions {self.dimensions} is not supported: this model's "
                               f"embeddings have {width}, and shortened embeddings are not offered; omit "
                               "dimensions or give the model's width")

    def requests(self, ids: Sequence[Sequence[int]], ctx_size: int, *, n_vocab: int,
                 pooling: Pooling) -> list[GenerationRequest]:
        """One engine request per tokenized input, after the vocabulary and context checks (400s).
        An input must leave a position free, as a generation's prompt does (docs/PROTOCOL.md §9.3)."""
        requests = []
        for index, (given, token_ids) in enumerate(zip(self.inputs, ids, strict=True)):
            name = f"input[{index}]" if len(self.inputs) > 1 else "input"
            if not token_ids:
                raise ApiError.invalid(name, f"{name} gives no tokens")
            bad = next((token for token in token_ids if not 0 <= token < n_vocab), None)
            if bad is not None:
                raise ApiError.invalid(name, f"{name} holds token id {bad}; the vocabulary has ids 0..{n_vocab - 1}")
            if len(token_ids) >= ctx_size:
                raise ApiError.context_length(name, f"the context holds {ctx_size} tokens and {name} has "
                                              f"{len(token_ids)}; an input may have at most {ctx_size - 1}",
                                              n_prompt_tokens=len(token_ids), n_ctx=ctx_size)
            requests.append(GenerationRequest(prompt=given if isinstance(given, str) else "", max_tokens=0,
                                              prompt_ids=tuple(token_ids), embedding=pooling))
        return requests

    def encoded(self, vector: npt.NDArray[np.float32]) -> list[float] | str:
        """One vector as the request's encoding_format asks: floats, or base64 of little-endian float32."""
        if self.encoding_format == "base64":
            return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
        return [float(x) for x in np.asarray(vector, dtype=np.float32)]

    def response(self, vectors: Sequence[npt.NDArray[np.float32]], model: str, prompt_tokens: int) -> JsonObject:
        """OpenAI's embeddings list, in input order."""
        data = [{"object": "embedding", "index": index, "embedding": self.encoded(vector)}
                for index, vector in enumerate(vectors)]
        return {"object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def per_token_response(vectors: Sequence[npt.NDArray[np.float32]], n_embd: int) -> list[JsonObject]:
    """llama-server's /embeddings answer with --pooling none: per input, in order, its rows (one per token, each
    n_embd floats, unnormalized)."""
    return [{"index": index, "embedding": np.asarray(vector, dtype=np.float32).reshape(-1, n_embd).tolist()}
            for index, vector in enumerate(vectors)]


def check_per_token_size(ids: Sequence[Sequence[int]], n_embd: int) -> None:
    """400 naming an input whose rows (tokens x n_embd floats, --pooling none) would not fit one reply."""
    limit = MAX_EMBEDDING_VALUES // n_embd
    for index, token_ids in enumerate(ids):
        if len(token_ids) > limit:
            name = f"input[{index}]" if len(ids) > 1 else "input"
            raise ApiError.invalid(name, f"{name} has {len(token_ids)} tokens; with --pooling none an input may have "
                                   f"at most {limit} (its rows of {n_embd} floats travel in one reply)")
