"""POST /rerank: bodies, prompts as llama-server builds them, Jina's and TEI's answers, and the route."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from hypothesis import given

from skippy_zmq.gateway.openai_api import ApiError
from skippy_zmq.gateway.rerank_api import MAX_RERANK_DOCUMENTS, RerankParams, RerankPrompts
from skippy_zmq.gateway.state import AttachedEngine, GatewayState
from skippy_zmq.tokens.pooling import Pooling
from tests.gateway.fakes import N_EMBD, TOKENIZER, FakeEngine, fake_vector, render_chat
from tests.gateway.test_http import post, run_client
from tests.strategies import hostile_json

DOCS = ["a machine", "learning is", "machine learning is a field", "Paris"]


def _params(body: Any) -> RerankParams:
    return RerankParams.from_json(json.dumps(body).encode())


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"documents": ["a"]}, "query", '"query" must be provided'),
    ({"query": 3, "documents": ["a"]}, "query", '"query" must be a string, got 3'),
    ({"query": "q", "documents": []}, "documents", '"documents" must be a non-empty string array, got []'),
    ({"query": "q", "documents": None}, "documents", "must be a non-empty string array, got None"),
    ({"query": "q", "documents": 123}, "documents", "got 123"),
    ({"query": "q", "documents": [1, 2, 3]}, "documents", "documents[0] must be a string, got 1"),
    ({"query": "q", "texts": ["a", None]}, "texts", "texts[1] must be a string, got None"),
    ({"query": "q", "documents": ["a"] * (MAX_RERANK_DOCUMENTS + 1)}, "documents", "at most 2048"),
    ({"query": "q", "documents": ["a"], "top_n": -1}, "top_n", "top_n must be an integer >= 0, got -1"),
    ({"query": "q", "documents": ["a"], "top_n": 1.5}, "top_n", "got 1.5"),
    ({"query": "q", "documents": ["a"], "return_text": "yes"}, "return_text", "must be a boolean"),
    ({"query": "q", "documents": ["a"], "model": 7}, "model", "model must be a string"),
    ({"query": "q", "documents": ["a"], "rank_fields": ["x"]}, "rank_fields", "unknown field 'rank_fields'"),
    (["q"], None, "must be a JSON object"),
])
def test_a_bad_body_is_a_400_naming_the_field(body: Any, param: str | None, message: str) -> None:
    with pytest.raises(ApiError) as caught:
        _params(body)
    assert caught.value.status == 400 and caught.value.param == param
    assert message in str(caught.value)


@given(hostile_json(["query", "documents", "texts", "top_n", "return_text", "return_documents", "model"]))
def test_any_json_body_is_either_valid_or_a_400(body: bytes) -> None:
    try:
        params = RerankParams.from_json(body)
    except ApiError as exc:
        assert exc.status == 400
    else:
        assert params.documents and all(isinstance(document, str) for document in params.documents)


def test_documents_win_over_texts_and_texts_alone_ask_for_teis_answer() -> None:
    both = _params({"query": "q", "documents": ["d"], "texts": ["t"]})
    assert (both.documents, both.tei) == (("d",), False)
    tei = _params({"query": "q", "texts": ["t"], "top_n": 0, "return_text": True})
    assert (tei.documents, tei.tei, tei.top_n, tei.return_text) == (("t",), True, 0, True)


def test_results_go_best_first_ties_in_document_order_cut_to_top_n() -> None:
    scores = [0.5, 2.0, 0.5, -1.0]
    jina = _params({"query": "q", "documents": DOCS, "top_n": 3, "return_documents": True, "model": "m2"})
    answer = jina.response(scores, "served", prompt_tokens=21)
    assert isinstance(answer, dict)
    assert answer["model"] == "m2" and answer["object"] == "list"
    assert answer["usage"] == {"prompt_tokens": 21, "total_tokens": 21}
    assert answer["results"] == [{"index": 1, "relevance_score": 2.0, "document": {"text": DOCS[1]}},
                                 {"index": 0, "relevance_score": 0.5, "document": {"text": DOCS[0]}},
                                 {"index": 2, "relevance_score": 0.5, "document": {"text": DOCS[2]}}]
    tei = _params({"query": "q", "texts": DOCS, "return_text": True}).response(scores, "served", 21)
    assert tei == [{"index": 1, "score": 2.0, "text": DOCS[1]}, {"index": 0, "score": 0.5, "text": DOCS[0]},
                   {"index": 2, "score": 0.5, "text": DOCS[2]}, {"index": 3, "score": -1.0, "text": DOCS[3]}]
    assert _params({"query": "q", "texts": DOCS, "top_n": 99}).response(scores, "served", 1) == [
        {"index": i, "score": s} for i, s in ((1, 2.0), (0, 0.5), (2, 0.5), (3, -1.0))]


def test_a_prompt_without_a_template_is_bos_query_then_document_as_llama_server_builds_it() -> None:
    ids = RerankPrompts().ids(TOKENIZER, "who", "me")
    bos = [TOKENIZER.bos_id] if TOKENIZER.add_bos and TOKENIZER.bos_id is not None else []
    eos = [TOKENIZER.eos_id] if TOKENIZER.add_eos and TOKENIZER.eos_id is not None else []
    want = [*bos, *TOKENIZER.encode("who", add_special=False), *eos,
            *TOKENIZER.encode("me", add_special=False), *eos]
    assert ids == want


def test_a_rerank_template_replaces_query_then_document_and_parses_special_tokens() -> None:
    prompts = RerankPrompts("Q: {query} D: {document} ({query})")
    # a query holding "{document}" gets the document put in it too, as llama-server's replace-all does
    assert prompts.ids(TOKENIZER, "x{document}", "d") == TOKENIZER.encode(
        "Q: xd D: d (xd)", add_special=False, parse_special=True)


def _backend(engine: FakeEngine, *, rerank: bool = True) -> GatewayState:
    backend = GatewayState("/models/tiny-model.gguf")
    backend.attach(AttachedEngine(engine, TOKENIZER, render_chat, n_embd=N_EMBD,  # type: ignore[arg-type]
                                  rerank=RerankPrompts() if rerank else None))
    return backend


def test_the_route_scores_every_prompt_rank_pooled_and_answers_in_both_shapes() -> None:
    engine = FakeEngine()
    prompts = [RerankPrompts().ids(TOKENIZER, "machine", document) for document in DOCS]
    scores = [float(fake_vector(ids)[0]) for ids in prompts]  # the fake engine's "rank head": the vector's first value
    best_first = sorted(range(len(DOCS)), key=lambda index: (-scores[index], index))

    async def scenario(client: TestClient[Any, Any]) -> None:
        status, _, body = await post(client, "/rerank", {"query": "machine", "documents": DOCS})
        assert status == 200, body
        assert [result["index"] for result in body["results"]] == best_first
        assert [result["relevance_score"] for result in body["results"]] == pytest.approx(
            [scores[index] for index in best_first])
        assert body["usage"]["prompt_tokens"] == sum(len(ids) for ids in prompts)
        submitted = engine.submitted[-len(DOCS):]
        assert [ticket.request.prompt_ids for ticket in submitted] == [tuple(ids) for ids in prompts]
        assert {(ticket.request.embedding, ticket.request.max_tokens) for ticket in submitted} == {(Pooling.RANK, 0)}
        status, _, tei = await post(client, "/v1/rerank", {"query": "machine", "texts": DOCS, "top_n": 2})
        assert status == 200 and [result["index"] for result in tei] == best_first[:2]

    run_client(_backend(engine), scenario)


def test_without_reranking_the_route_is_a_501_saying_how_to_turn_it_on() -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        status, _, body = await post(client, "/reranking", {"query": "q", "documents": ["d"]})
        assert status == 501 and body["error"]["type"] == "not_supported_error"
        assert "--reranking" in body["error"]["message"]
        status, _, body = await post(client, "/rerank", {"query": "q", "documents": []})
        assert status == 400 and body["error"]["param"] == "documents"

    run_client(_backend(FakeEngine(), rerank=False), scenario)


# --- through a real serve ------------------------------------------------------------------------


@pytest.mark.slow
def test_a_real_serve_scores_as_llama_cpps_rank_pooling_and_lists_its_tags(tiny_serve: Any,
                                                                          tiny_gemma3_path: Path) -> None:
    import requests

    from skippy_zmq.tokens.tokenizer import Tokenizer
    from tests.tokens.test_pooling import _llama_cpp_rank

    query = "the machine"
    answer = requests.post(f"{tiny_serve.url}/rerank", json={"query": query, "documents": DOCS}, timeout=120)
    assert answer.status_code == 200, answer.text
    tokenizer = Tokenizer.from_gguf(tiny_gemma3_path)
    prompts = [RerankPrompts().ids(tokenizer, query, document) for document in DOCS]
    want = [float(_llama_cpp_rank(tiny_gemma3_path, ids, kv_type=1)[0]) for ids in prompts]  # serve's F16 KV
    got = {result["index"]: result["relevance_score"] for result in answer.json()["results"]}
    assert [got[index] for index in range(len(DOCS))] == pytest.approx(want, rel=1e-3, abs=1e-4)
    assert answer.json()["usage"]["prompt_tokens"] == sum(len(ids) for ids in prompts)
    models = requests.get(f"{tiny_serve.url}/v1/models", timeout=30).json()["data"][0]
    assert models["tags"] == ["chat", "small"] and models["aliases"] == [models["id"]]
