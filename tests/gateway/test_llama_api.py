"""Tests of skippy_zmq.gateway.llama_api, in-process: llama-server's /tokenize, /detokenize, /props and
the native /completion's validation, its CompletionParams, its answer and stream events."""

from __future__ import annotations

import json
import math
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_zmq.driver.generation import GenerationRequest, GenerationResult
from skippy_zmq.gateway.llama_api import (
    NATIVE_DEFAULTS,
    NATIVE_FIELDS,
    DetokenizeRequest,
    NativeCompletion,
    NativeShape,
    ServerProps,
    TokenizeRequest,
    completion_probabilities,
    detokenize,
    piece_json,
    read_json,
    stopping_word,
    timings,
    tokenize,
)
from skippy_zmq.gateway.openai_api import ApiError, Endpoint
from skippy_zmq.testing.tiny import vocab_tokenizer
from skippy_zmq.tokens.logprobs import TokenLogprobs
from skippy_zmq.tokens.sampling import SamplingParams
from skippy_zmq.tokens.tokenizer import TOKEN_TYPE_BYTE, TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL, Tokenizer
from tests.strategies import hostile_json

BYTE0 = 5  # id of <0x00>


def tokenizer() -> Tokenizer:
    """<pad> <eos> <bos> <start_of_turn> (control), "hi" (normal), then the 256 byte tokens."""
    tokens = [b"<pad>", b"<eos>", b"<bos>", b"<start_of_turn>", b"hi"] + [f"<0x{b:02X}>".encode() for b in range(256)]
    types = [TOKEN_TYPE_CONTROL] * 4 + [TOKEN_TYPE_NORMAL] + [TOKEN_TYPE_BYTE] * 256
    scores = [0.0] * 4 + [1.0] + [0.0] * 256
    return vocab_tokenizer(tokens, scores, types, bos_id=2, eos_id=1, pad_id=0)


TOK = tokenizer()


def ids_of(data: bytes) -> list[int]:
    return [BYTE0 + byte for byte in data]


def refused(call: Any, param: str | None) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call()
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message
    return caught.value


# --- /tokenize and /detokenize -----------------------------------------------------------------


def test_tokenize_gives_ids_without_bos_and_parses_special_texts_by_default() -> None:
    answer = tokenize(TOK, TokenizeRequest.from_body({"content": "<start_of_turn>hi"}))
    assert answer == {"tokens": [3, 4]}
    plain = tokenize(TOK, TokenizeRequest.from_body({"content": "hi", "add_special": True, "parse_special": False}))
    assert plain == {"tokens": [2, 4]}
    typed = tokenize(TOK, TokenizeRequest.from_body({"content": "<b", "parse_special": False}))
    assert typed == {"tokens": ids_of(b"<b")}


def test_text_that_cannot_be_tokenized_is_a_400_and_no_bos_is_added_without_one() -> None:
    refused(lambda: tokenize(TOK, TokenizeRequest("a\ud800")), "content")
    tokens = [f"<0x{b:02X}>".encode() for b in range(256)] + [b"a"]
    no_bos = vocab_tokenizer(tokens, [0.0] * 257, [TOKEN_TYPE_BYTE] * 256 + [TOKEN_TYPE_NORMAL], add_bos=False)
    assert tokenize(no_bos, TokenizeRequest("a", add_special=True)) == {"tokens": [256]}


def test_pieces_are_text_when_valid_utf8_else_byte_values() -> None:
    body = {"content": "<start_of_turn>hi\u00e1", "with_pieces": True}
    answer = tokenize(TOK, TokenizeRequest.from_body(body))
    assert answer == {"tokens": [{"id": 3, "piece": "<start_of_turn>"}, {"id": 4, "piece": "hi"},
                                 {"id": BYTE0 + 0xC3, "piece": [0xC3]}, {"id": BYTE0 + 0xA1, "piece": [0xA1]}]}
    assert piece_json(b"a") == "a" and piece_json(b"\xe2\x82") == [0xE2, 0x82]


@pytest.mark.parametrize(("body", "param"), [
    ({}, "content"),
    ({"content": 3}, "content"),
    ({"content": "x", "add_special": 1}, "add_special"),
    ({"content": "x", "with_pieces": "yes"}, "with_pieces"),
    ({"content": "x", "parse_special": None, "bogus": 1}, "bogus"),
    ([], None),
])
def test_bad_tokenize_bodies_are_400s_naming_the_field(body: Any, param: str | None) -> None:
    refused(lambda: TokenizeRequest.from_body(body), param)


def test_detokenize_joins_pieces_with_control_texts_and_refuses_ids_outside_the_vocab() -> None:
    tokens = (2, 4, *ids_of(" \u00e1".encode()), BYTE0 + 0xC3)
    assert detokenize(TOK, DetokenizeRequest.from_body({"tokens": list(tokens)})) == {"content": "<bos>hi \u00e1\ufffd"}
    assert detokenize(TOK, DetokenizeRequest.from_body({})) == {"content": ""}
    error = refused(lambda: detokenize(TOK, DetokenizeRequest((4, TOK.n_vocab))), "tokens")
    assert f"tokens[1] is {TOK.n_vocab}" in error.message
    for bad in ([-1], ["a"], [True], "1 2", [2**31]):
        refused(lambda bad=bad: DetokenizeRequest.from_body({"tokens": bad}), "tokens")


# --- /props -------------------------------------------------------------------------------------


def test_props_reports_the_model_context_lanes_template_and_defaults() -> None:
    props = ServerProps("tiny", "/m/tiny.gguf", n_ctx=512, total_slots=4, chat_template="{{ x }}").as_json()
    assert props["model_path"] == "/m/tiny.gguf" and props["model_alias"] == "tiny"
    assert props["total_slots"] == 4 and props["chat_template"] == "{{ x }}"
    settings_ = props["default_generation_settings"]
    assert settings_["n_ctx"] == 512
    assert settings_["params"]["temperature"] == NATIVE_DEFAULTS.temperature == 0.8
    assert settings_["params"]["top_k"] == 40 and settings_["params"]["n_predict"] == -1
    assert props["build_info"].startswith("skippy-zmq ")
    assert ServerProps("tiny", "tiny", 8, 1).as_json()["chat_template"] is None
    json.dumps(props)


# --- /completion: validation -------------------------------------------------------------------


def test_defaults_are_llama_servers_and_become_completion_params() -> None:
    native = NativeCompletion.from_body({"prompt": "hi"})
    params = native.params()
    assert params.endpoint is Endpoint.COMPLETIONS and params.prompt == "hi"
    assert params.max_tokens is None and params.max_tokens_field == "n_predict"
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (0.8, 40, 0.95, 0.05)
    assert params.logprobs is None and params.seed is None and not params.stream


def test_fields_reach_the_params_and_the_engine_request() -> None:
    body = {"prompt": [2, 4], "n_predict": 7, "stream": True, "stop": ["\n", ""], "temperature": -1, "top_k": -1,
            "top_p": 0.5, "min_p": 0.1, "seed": 42, "n_probs": 3, "ignore_eos": True, "repeat_penalty": 1.2,
            "repeat_last_n": 16, "presence_penalty": 0.5, "frequency_penalty": -0.5, "cache_prompt": True,
            "n_keep": -1, "return_tokens": True, "model": "tiny", "typical_p": 1, "post_sampling_probs": False}
    native = NativeCompletion.from_body(body)
    params = native.params()
    assert params.prompt == (2, 4) and params.max_tokens == 7 and params.stop == ("\n",)
    assert (params.temperature, params.top_k, params.seed, params.logprobs) == (0.0, 0, 42, 3)
    assert (params.presence_penalty, params.frequency_penalty, params.ignore_eos) == (0.5, -0.5, True)
    assert params.model == "tiny" and params.stream and params.repeat_penalty == 1.2
    request = native.finish(GenerationRequest("", max_tokens=7, sampling=SamplingParams(seed=42), prompt_ids=(2, 4)))
    assert request.logprobs == 3
    assert (request.sampling.penalty_last_n, request.sampling.presence_penalty) == (16, 0.5)
    assert request.sampling.frequency_penalty == -0.5
    assert native.settings(request)["seed"] == 42 and native.settings(request)["repeat_last_n"] == 16
    assert NativeCompletion.from_body({"prompt": "x", "seed": -1}).seed is None
    assert NativeCompletion.from_body({"prompt": ["x"]}).prompt == "x"


@pytest.mark.parametrize(("field", "value"), [
    ("prompt", 3), ("prompt", []), ("prompt", ["a", "b"]), ("prompt", [1, "a", [2]]), ("prompt", [-1]),
        ("prompt", [-1, "a"]),
    ("n_predict", -2), ("n_predict", 1.5), ("n_predict", 2**31), ("stream", "true"), ("stop", [1]),
    ("stop", ["s"] * 17), ("temperature", "hot"), ("temperature", 1e7), ("top_k", 2**31), ("top_p", 1.5),
    ("min_p", -0.1), ("seed", -2), ("seed", 2**64), ("n_probs", 21), ("n_probs", -1), ("ignore_eos", 0),
    ("repeat_penalty", 0), ("repeat_last_n", -2), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("cache_prompt", "no"), ("model", 5), ("typical_p", 0.9), ("mirostat", 2), ("id_slot", 0),
    ("post_sampling_probs", 1), ("timings_per_token", 1), ("grammar", ""), ("n_cmpl", 2),
    ("prompt", ["a"] * 65), ("response_fields", "content"), ("response_fields", [1]), ("max_tokens", -2),
    ("response_fields", ["a"] * 65), ("verbose", "yes"), ("backend_sampling", 0),
    ("speculative.n_max", 33), ("speculative.n_max", -1), ("speculative.n_max", True), ("speculative.n_min", 1.5),
    ("speculative.p_min", 2),
])
def test_every_bad_field_is_a_400_naming_it(field: str, value: Any) -> None:
    body = {"prompt": "x", field: value}
    error = refused(lambda: NativeCompletion.from_body(body), field)
    assert field in error.message


def test_a_batch_of_prompts_is_one_request_each_with_the_bodys_other_fields() -> None:
    """llama-server's rule: a list that holds no number is a list of prompts, one with numbers is one prompt."""
    batch = NativeCompletion.batch_from_body({"prompt": [[2, 4], "ab", {"prompt_string": "x"}, [5, "y"]],
                                              "n_predict": 3, "seed": 7})
    assert [native.prompt for native in batch] == [(2, 4), "ab", "x", (5, "y")]
    assert [native.index for native in batch] == [0, 1, 2, 3]
    assert {(native.n_predict, native.seed) for native in batch} == {(3, 7)}
    assert [n.prompt for n in NativeCompletion.batch_from_body({"prompt": ["ab", 6]})] == [("ab", 6)]
    assert [n.prompt for n in NativeCompletion.batch_from_body({"prompt": "ab"})] == ["ab"]
    with pytest.raises(ApiError, match="prompt holds 2 prompts"):  # the one-prompt reader refuses a batch
        NativeCompletion.from_body({"prompt": ["a", "b"]})
    refused(lambda: NativeCompletion.batch_from_body({"prompt": [[2], [-1]]}), "prompt[1]")
    refused(lambda: NativeCompletion.batch_from_body({"prompt": [["a"]]}), "prompt[0]")


def test_max_tokens_stands_for_n_predict_when_it_is_absent() -> None:
    assert NativeCompletion.from_body({"prompt": "x", "max_tokens": 5}).n_predict == 5
    assert NativeCompletion.from_body({"prompt": "x", "max_completion_tokens": 4}).n_predict == 4
    assert NativeCompletion.from_body({"prompt": "x", "max_tokens": 5, "n_predict": 2}).n_predict == 2


def test_a_missing_prompt_and_a_body_that_is_not_an_object_are_400s() -> None:
    refused(lambda: NativeCompletion.from_body({"n_predict": 3}), "prompt")
    refused(lambda: NativeCompletion.from_json(b"[1]"), None)
    refused(lambda: NativeCompletion.from_json(b"{"), None)
    refused(lambda: NativeCompletion.from_json(b'{"prompt": "\\ud800"}'), "prompt")


@given(data=hostile_json([*NATIVE_FIELDS, "content", "tokens"], {"prompt": st.just("x")}))
@settings(max_examples=200, deadline=None)
def test_any_json_body_parses_or_is_a_400(data: bytes) -> None:
    for parse in (lambda d: NativeCompletion.from_json(d).tokenized(TOK), lambda d: TokenizeRequest.from_body(read_json(d)),
                  lambda d: DetokenizeRequest.from_body(read_json(d))):
        try:
            parsed = parse(data)
        except ApiError as error:
            assert error.status == 400
            continue
        if isinstance(parsed, NativeCompletion):
            parsed.params().sampling()  # what it parsed is a valid sampler
        elif isinstance(parsed, TokenizeRequest):
            tokenize(TOK, parsed)


# --- /completion: answers ----------------------------------------------------------------------


def result_of(text: bytes, reason: str, *, extra: bytes = b"", prompt: tuple[int, ...] = (2, 4)) -> GenerationResult:
    """A result whose tokens are the bytes of `text + extra` (`extra`: what a stop string cut off)."""
    return GenerationResult(prompt="", prompt_ids=list(prompt), tokens=ids_of(text + extra),
                            text=(text).decode("utf-8", "replace"), finish_reason=reason)


def test_stopping_word_is_the_stop_string_the_text_was_cut_at() -> None:
    result = result_of(b"one two", "stop", extra=b"\nthree")
    assert stopping_word(TOK, result, ("three", "\n", "\nth")) == "\n"
    assert stopping_word(TOK, result_of(b"x", "length"), ("x",)) == ""


def test_completion_probabilities_shape_with_bytes_and_cut_utf8() -> None:
    entries = [TokenLogprobs(BYTE0 + 0xC3, -0.5, ((BYTE0 + 0xC3, -0.5), (4, -1.25))), TokenLogprobs(1, -3.0)]
    assert completion_probabilities(TOK, entries) == [
        {"id": BYTE0 + 0xC3, "token": "", "bytes": [0xC3], "logprob": -0.5,
         "top_logprobs": [{"id": BYTE0 + 0xC3, "token": "", "bytes": [0xC3], "logprob": -0.5},
                          {"id": 4, "token": "hi", "bytes": [104, 105], "logprob": -1.25}]},
        {"id": 1, "token": "", "bytes": [], "logprob": -3.0, "top_logprobs": []},
    ]


def test_timings_measure_prompt_and_generation() -> None:
    result = result_of(b"abcd", "length")
    result.started_s, result.first_token_s, result.finished_s = 10.0, 10.5, 11.5
    got = timings(result)
    assert (got["prompt_n"], got["predicted_n"]) == (2, 4)
    assert got["prompt_ms"] == pytest.approx(500.0) and got["predicted_ms"] == pytest.approx(1000.0)
    # llama-server's rate counts the 3 steps after the first token, which the prompt's last step gave
    assert got["predicted_per_second"] == pytest.approx(3.0) and got["predicted_per_token_ms"] == pytest.approx(1e3 / 3)
    assert got["prompt_per_token_ms"] == pytest.approx(250.0)
    assert got["cache_n"] == 0
    result.cached_tokens = 1  # a kept session held the first prompt token: one was computed
    assert (timings(result)["cache_n"], timings(result)["prompt_n"]) == (1, 1)
    unmeasured = timings(result_of(b"", "length"))
    assert unmeasured["predicted_per_second"] == 0.0 and unmeasured["prompt_ms"] == 0.0  # 0.0, never null
    one = result_of(b"a", "length")
    one.started_s, one.first_token_s, one.finished_s = 10.0, 10.5, 10.5
    assert (timings(one)["predicted_per_second"], timings(one)["predicted_per_token_ms"]) == (0.0, 0.0)
    assert "draft_n" not in got  # llama-server's draft counts appear only when the steps carried drafts
    result.drafts, result.drafts_accepted = 12, 9
    assert (timings(result)["draft_n"], timings(result)["draft_n_accepted"]) == (12, 9)


def test_speculative_n_max_is_the_request_s_draft_budget_over_the_server_s() -> None:
    request = GenerationRequest("", max_tokens=8, prompt_ids=(2, 4))
    drafted = NativeCompletion.from_body({"prompt": "x", "speculative.n_max": 6, "speculative.p_min": 0.5})
    assert drafted.params().generation_request((2, 4), 64, n_vocab=300).draft_max == 6
    plain = NativeCompletion.from_body({"prompt": "x"})
    assert plain.params().generation_request((2, 4), 64, n_vocab=300).draft_max is None  # serve's --draft-max
    assert request.draft_max is None


def shape(body: dict[str, Any], n_ctx: int = 64) -> NativeShape:
    native = NativeCompletion.from_body({"prompt": [2, 4], **body})
    request = GenerationRequest("", max_tokens=8, sampling=SamplingParams(seed=9), prompt_ids=(2, 4))
    return NativeShape("tiny", native, native.finish(request), TOK, n_ctx)


def test_the_whole_answer_has_llama_servers_fields() -> None:
    result = result_of(b"ab", "stop", extra=b"|")
    result.logprobs = [TokenLogprobs(BYTE0 + 97, -0.1), TokenLogprobs(BYTE0 + 98, -0.2)]
    answer = shape({"stop": ["|"], "n_probs": 1}).final(result)
    assert answer["content"] == "ab" and answer["stop"] is True and answer["model"] == "tiny"
    assert answer["tokens"] == [] and answer["tokens_predicted"] == 3 and answer["tokens_evaluated"] == 2
    assert (answer["stop_type"], answer["stopping_word"], answer["truncated"]) == ("word", "|", False)
    assert answer["prompt"] == "<bos>hi" and answer["generation_settings"]["seed"] == 9
    assert [entry["id"] for entry in answer["completion_probabilities"]] == [BYTE0 + 97, BYTE0 + 98]
    assert answer["timings"]["predicted_n"] == 3
    assert shape({"return_tokens": True}).final(result)["tokens"] == result.tokens
    assert "completion_probabilities" not in shape({}).final(result)
    assert shape({}).final(result_of(b"a", "eos"))["stop_type"] == "eos"
    full = shape({}, n_ctx=3).final(result_of(b"a", "length"))
    assert (full["stop_type"], full["truncated"]) == ("limit", True)
    json.dumps(answer)


def test_response_fields_keep_the_listed_paths_each_under_its_path() -> None:
    result = result_of(b"a\nb", "length")
    answer = shape({"n_predict": 5, "response_fields": ["content", "generation_settings/n_predict", "nothing",
                                                         "content/deeper", "has_new_line"]}).final(result)
    assert answer == {"content": "a\nb", "generation_settings/n_predict": 5, "has_new_line": True}
    assert shape({}).final(result_of(b"ab", "length"))["has_new_line"] is False
    assert len(shape({"response_fields": []}).final(result)) > 10  # an empty list keeps everything


def test_post_sampling_probs_answer_probabilities_under_llama_servers_names() -> None:
    sampled = shape({"n_probs": 2, "post_sampling_probs": True})
    assert sampled.generation.post_sampling_probs and sampled.generation.logprobs == 2
    assert not shape({"post_sampling_probs": True}).generation.post_sampling_probs  # without n_probs: nothing
    entry = TokenLogprobs(BYTE0 + 97, math.log(0.75), ((BYTE0 + 97, math.log(0.75)), (BYTE0 + 98, math.log(0.25))))
    result = result_of(b"a", "length")
    result.logprobs = [entry]
    (token,) = sampled.final(result)["completion_probabilities"]
    assert token["prob"] == pytest.approx(0.75) and "logprob" not in token and "top_logprobs" not in token
    assert [(alt["token"], alt["prob"]) for alt in token["top_probs"]] == [("a", pytest.approx(0.75)),
                                                                          ("b", pytest.approx(0.25))]
    streamed = shape({"n_probs": 2, "post_sampling_probs": True, "stream": True})
    assert "top_probs" in streamed.partial("a", [BYTE0 + 97], [entry], 1)["completion_probabilities"][0]
    assert sampled.final(result)["generation_settings"]["post_sampling_probs"] is True


def test_stream_events_carry_each_piece_then_the_totals_without_text() -> None:
    streamed = shape({"stream": True, "n_probs": 2, "return_tokens": True})
    event = streamed.partial("a", [BYTE0 + 97], [TokenLogprobs(BYTE0 + 97, -0.1, ((BYTE0 + 97, -0.1),))], 1)
    assert (event["content"], event["tokens"], event["stop"], event["tokens_predicted"]) == ("a", [BYTE0 + 97],
                                                                                            False, 1)
    assert event["completion_probabilities"][0]["top_logprobs"][0]["token"] == "a"
    assert "completion_probabilities" not in shape({"stream": True}).partial("a", [BYTE0 + 97], [], 1)
    last = streamed.final(result_of(b"ab", "length"))
    assert (last["content"], last["tokens"], last["stop"], last["stop_type"]) == ("", [], True, "limit")
    assert "completion_probabilities" not in last


def test_a_prompt_may_mix_token_ids_and_texts() -> None:
    """llama-server's mixed prompt: each text tokenized with control texts parsed, BOS before a first text."""
    native = NativeCompletion.from_body({"prompt": [5, "ab", 6]}).tokenized(TOK)
    assert native.prompt == (5, *TOK.encode("ab", add_special=False, parse_special=True), 6)
    first = NativeCompletion.from_body({"prompt": ["ab", 6]}).tokenized(TOK)
    assert first.prompt == (*TOK.encode("ab", add_special=True, parse_special=True), 6)
    assert NativeCompletion.from_body({"prompt": [[5, "ab"]]}).tokenized(TOK).prompt[0] == 5  # a one-prompt list
    # llama-server's JSON-object prompt; images and audio are refused
    assert NativeCompletion.from_body({"prompt": {"prompt_string": "ab"}}).prompt == "ab"
    for bad, where in (({"prompt_string": "a", "multimodal_data": ["iVBO"]}, "no images or audio"),
                       ({"text": "a"}, "holds 'text'"), ({"prompt_string": 5}, "must be a string")):
        with pytest.raises(ApiError, match=where):
            NativeCompletion.from_body({"prompt": bad})


def test_generation_settings_list_the_logit_bias_and_ignore_eos_as_minus_infinity() -> None:
    request = GenerationRequest("", max_tokens=8, sampling=SamplingParams(seed=9, logit_bias=((5, 1.5),)),
                                prompt_ids=(2,))
    plain = NativeCompletion.from_body({"prompt": [2], "logit_bias": [[5, 1.5]]})
    assert plain.settings(request, TOK.eog_ids)["logit_bias"] == [{"bias": 1.5, "token": 5}]
    ignoring = NativeCompletion.from_body({"prompt": [2], "ignore_eos": True})
    listed = ignoring.settings(attrs.evolve(request, sampling=SamplingParams(seed=9)), TOK.eog_ids)["logit_bias"]
    assert listed == [{"bias": None, "token": token} for token in sorted(TOK.eog_ids)] and listed


def test_logit_bias_in_llama_servers_forms_and_the_parameters_of_samplers_left_off() -> None:
    native = NativeCompletion.from_body({"prompt": "x", "logit_bias": [[7, False], [5, 1.5]]}).tokenized(TOK)
    assert native.logit_bias == ((5, 1.5), (7, -100.0)) and native.params().logit_bias == native.logit_bias
    assert NativeCompletion.from_body({"prompt": "x", "logit_bias": {"9": -2}}).logit_bias == ((9, -2.0),)
    # a text biases each of its tokens, as llama-server's [["text", bias]] and {"text": bias}
    for form in ([["ab", False]], {"ab": False}):
        texted = NativeCompletion.from_body({"prompt": "x", "logit_bias": form}).tokenized(TOK)
        assert texted.logit_bias == tuple((token, -100.0) for token in sorted(TOK.encode("ab", add_special=False)))
    for bad, where in (([[5, 101]], "bias 101 must be a number"), ([[-5, 1]], "must be an integer in"),
                       ([[5, 1], [5, 2]], "names token 5 twice"), ("5", "must be [[token id, bias], ...]")):
        with pytest.raises(ApiError) as info:
            NativeCompletion.from_body({"prompt": "x", "logit_bias": bad})
        assert info.value.param == "logit_bias" and where in info.value.message
    ignored = {"mirostat_tau": 5.0, "mirostat_eta": 0.1, "dry_base": 1.75, "dry_allowed_length": 2,
               "dry_penalty_last_n": -1, "dry_sequence_breakers": ["\n"], "xtc_threshold": 0.1,
               "dynatemp_exponent": 1.0, "n_discard": 0, "samplers": ["penalties", "top_k", "top_p", "min_p",
                                                                     "temperature"]}
    assert NativeCompletion.from_body({"prompt": "x", **ignored}).prompt == "x"
    with pytest.raises(ApiError) as info:
        NativeCompletion.from_body({"prompt": "x", "mirostat": 2})
    assert info.value.message == "mirostat 2 is not supported; only 0 (or null) is accepted"


# --- prompt progress and per-token timings, through a real serve ---------------------------------------------


def _events(raw: str) -> list[dict[str, Any]]:
    return [json.loads(line.removeprefix("data: ")) for line in raw.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def _check_progress(reports: list[dict[str, Any]], chunk: int = 16) -> None:
    """The reports a prompt in chunks of `chunk` gives: one before any position runs, one per chunk, the last whole."""
    total = reports[0]["total"]
    assert reports[0]["processed"] == reports[0]["cache"] == 0
    assert [report["processed"] for report in reports] == [*range(0, total, chunk), total]
    assert all(report["total"] == total and report["cache"] == 0 for report in reports)
    assert [report["time_ms"] for report in reports] == sorted(report["time_ms"] for report in reports)


@pytest.mark.slow
def test_a_stream_reports_its_prompts_progress_with_timings_on_every_route(tiny_serve: Any) -> None:
    import requests

    prompt = "the quick brown fox jumps over the lazy dog " * 8
    raw = requests.post(f"{tiny_serve.url}/completion", timeout=120, json={
        "prompt": prompt, "n_predict": 4, "stream": True, "return_progress": True, "timings_per_token": True}).text
    events = _events(raw)
    progress = [event for event in events if "prompt_progress" in event]
    assert progress[0]["prompt_progress"]["total"] > 32  # several chunks of 16
    _check_progress([event["prompt_progress"] for event in progress])
    assert progress[0]["timings"]["prompt_n"] == 0 and progress[0]["timings"]["prompt_ms"] == 0.0
    assert all(event["content"] == "" and event["tokens"] == [] for event in progress)
    prompt_ms = [event["timings"]["prompt_ms"] for event in progress]
    assert prompt_ms == sorted(prompt_ms) and prompt_ms[-1] > 0
    texts = [event for event in events if event.get("content")]
    assert texts and all("timings" in event and event["timings"]["predicted_n"] >= 1 for event in texts)
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 3, "stream": True,
            "return_progress": True}
    chunks = _events(requests.post(f"{tiny_serve.url}/v1/chat/completions", json=chat, timeout=120).text)
    reports = [chunk for chunk in chunks if "prompt_progress" in chunk]
    _check_progress([chunk["prompt_progress"] for chunk in reports])
    assert all(chunk["choices"][0]["delta"] == {"role": "assistant", "content": None} for chunk in reports)
    assert not any("timings" in chunk for chunk in chunks[:-2])  # without timings_per_token: on the last only
    plain = _events(requests.post(f"{tiny_serve.url}/v1/chat/completions", timeout=120,
                                  json=chat | {"return_progress": False}).text)
    assert not any("prompt_progress" in chunk for chunk in plain)


@pytest.mark.slow
def test_the_responses_stream_reports_progress_in_progress_events_and_timings(tiny_serve: Any) -> None:
    import requests

    from tests.gateway.test_anthropic_api import sse_named

    raw = requests.post(f"{tiny_serve.url}/v1/responses", timeout=120, json={
        "input": "This is a test" * 10, "max_output_tokens": 8, "stream": True, "timings_per_token": True,
        "return_progress": True}).text
    events = [data for _, data in sse_named(raw)]
    reports = [data for data in events if "prompt_progress" in data]
    assert reports and all(data["type"] == "response.in_progress" for data in reports)
    _check_progress([data["prompt_progress"] for data in reports])
    deltas = [data for data in events if data["type"] == "response.output_text.delta"]
    assert deltas and all("predicted_per_second" in data["timings"] for data in deltas)
    assert "timings" in events[-1] and events[-1]["type"] in ("response.completed", "response.incomplete")
    assert [data["sequence_number"] for data in events] == list(range(len(events)))
