"""`POST /rerank` bodies, prompts and answers in llama-server's Jina and TEI shapes; socket-free
(docs/PROTOCOL.md §9.3, Reranking).

`RerankParams.from_json` validates a body into one frozen value: a `query` and its `documents`
(Jina, Cohere) or `texts` (Hugging Face TEI, which also changes the answer's shape). `RerankPrompts`
builds each (query, document) prompt as llama-server does: the file's `rerank` template
(`tokenizer.chat_template.rerank`, `{query}` and `{document}` in it, special tokens parsed) where it
has one, else BOS, the query, EOS or SEP as the vocabulary adds them, the document, EOS. The final
stage scores each prompt through the model's rank head (`tokens.pooling.RankHead`); `RerankParams.response`
sorts the scores, best first, and cuts them to `top_n`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from skippy_zmq.driver.generation import GenerationRequest
from skippy_zmq.gateway.openai_api import ApiError, JsonObject, checked_body, is_int, known_fields, shown_value
from skippy_zmq.model.gguf_file import ArchKey, GGUFHeader, GGUFKey
from skippy_zmq.tokens.pooling import Pooling
from skippy_zmq.tokens.tokenizer import Tokenizer

MAX_RERANK_DOCUMENTS = 2048
"""Documents per request: one prompt each, all submitted at once (as /v1/embeddings' inputs)."""
RANK_POOLING_TYPE = 4
"""llama.cpp's `{arch}.pooling_type` of a reranker (LLAMA_POOLING_TYPE_RANK): such a file is served with /rerank."""
_FIELDS = frozenset({"query", "documents", "texts", "top_n", "return_text", "return_documents", "model"})


def _documents(value: Any, name: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ApiError.invalid(name, f"\"{name}\" must be a non-empty string array, got {shown_value(value)}")
    if len(value) > MAX_RERANK_DOCUMENTS:
        raise ApiError.invalid(name, f"\"{name}\" holds {len(value)} documents; at most {MAX_RERANK_DOCUMENTS} are "
                               "accepted per request")
    bad = next((index for index, item in enumerate(value) if not isinstance(item, str)), None)
    if bad is not None:
        raise ApiError.invalid(name, f"{name}[{bad}] must be a string, got {shown_value(value[bad])}")
    return tuple(value)


@attrs.frozen
class RerankParams:
    """A validated rerank request."""

    query: str
    documents: tuple[str, ...]
    tei: bool = False  # the body named `texts`: the answer is TEI's bare list
    top_n: int | None = None  # None: every document
    return_text: bool = False  # TEI: each result carries its text
    return_documents: bool = False  # Jina/Cohere: each result carries {"text": ...}
    model: str | None = None

    @classmethod
    def from_json(cls, data: bytes) -> RerankParams:
        """Validate a body as received (UTF-8 JSON); ApiError 400 naming the field."""
        return cls.from_body(checked_body(data))

    @classmethod
    def from_body(cls, body: Any) -> RerankParams:
        """Validate a parsed body; ApiError 400 naming the first bad field (`null` = absent)."""
        fields = known_fields(body, _FIELDS, "/rerank")
        query = fields.get("query")
        if not isinstance(query, str):
            raise ApiError.invalid("query", "\"query\" must be provided" if query is None
                                   else f"\"query\" must be a string, got {shown_value(query)}")
        tei = "texts" in fields and "documents" not in fields
        name = "texts" if tei else "documents"
        documents = _documents(fields.get(name), name)
        top_n = fields.get("top_n")
        if top_n is not None and (not is_int(top_n) or top_n < 0):
            raise ApiError.invalid("top_n", f"top_n must be an integer >= 0, got {shown_value(top_n)}")
        for flag in ("return_text", "return_documents"):
            if not isinstance(fields.get(flag, False), bool):
                raise ApiError.invalid(flag, f"{flag} must be a boolean, got {shown_value(fields[flag])}")
        if "model" in fields and not isinstance(fields["model"], str):
            raise ApiError.invalid("model", f"model must be a string, got {shown_value(fields['model'])}")
        return cls(query, documents, tei, top_n,
                   fields.get("return_text", False), fields.get("return_documents", False), fields.get("model"))

    def requests(self, ids: Sequence[Sequence[int]], ctx_size: int) -> list[GenerationRequest]:
        """One rank-pooled engine request per document's prompt, after the context check (400 naming the
        document); a prompt must leave a position free, as an embedding input does."""
        requests = []
        for index, prompt_ids in enumerate(ids):
            if len(prompt_ids) >= ctx_size:
                name = f"documents[{index}]"
                raise ApiError.context_length(name, f"the context holds {ctx_size} tokens and the prompt of the query "
                                              f"with {name} has {len(prompt_ids)}; a prompt may have at most "
                                              f"{ctx_size - 1}", n_prompt_tokens=len(prompt_ids), n_ctx=ctx_size)
            requests.append(GenerationRequest(prompt="", max_tokens=0, prompt_ids=tuple(prompt_ids),
                                              embedding=Pooling.RANK))
        return requests

    def response(self, scores: Sequence[float], model: str, prompt_tokens: int) -> JsonObject | list[JsonObject]:
        """The documents by score, best first (ties in document order), cut to top_n: Jina's object, or TEI's
        list when the body named `texts`."""
        label = "score" if self.tei else "relevance_score"
        order = sorted(range(len(scores)), key=lambda index: (-scores[index], index))
        results: list[JsonObject] = []
        for index in order[: len(order) if self.top_n is None else self.top_n]:
            result: JsonObject = {"index": index, label: float(scores[index])}
            if self.tei and self.return_text:
                result["text"] = self.documents[index]
            if not self.tei and self.return_documents:
                result["document"] = {"text": self.documents[index]}
            results.append(result)
        if self.tei:
            return results
        return {"model": self.model or model, "object": "list",
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}, "results": results}


@attrs.frozen
class RerankPrompts:
    """How a (query, document) pair becomes a prompt on this model."""

    template: str | None = None  # the file's tokenizer.chat_template.rerank

    @classmethod
    def of_header(cls, header: GGUFHeader) -> RerankPrompts:
        """The file's rerank template, if it has one."""
        return cls(header.string(GGUFKey.RERANK_TEMPLATE, None))

    def ids(self, tokenizer: Tokenizer, query: str, document: str) -> list[int]:
        """The prompt's token ids, as llama-server's format_prompt_rerank builds them."""
        if self.template is not None:
            # Replaced in this order, each everywhere, as llama-server does.
            text = self.template.replace("{query}", query).replace("{document}", document)
            return tokenizer.encode(text, add_special=False, parse_special=True)
        ids = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
        ids += tokenizer.encode(query, add_special=False)
        end = tokenizer.eos_id if tokenizer.eos_id is not None else tokenizer.sep_id
        if tokenizer.add_eos and end is not None:
            ids.append(end)
        if tokenizer.add_sep and tokenizer.sep_id is not None:
            ids.append(tokenizer.sep_id)
        ids += tokenizer.encode(document, add_special=False)
        if tokenizer.add_eos and end is not None:
            ids.append(end)
        return ids


def declares_rank_pooling(header: GGUFHeader) -> bool:
    """Whether the file says it is a reranker (`{arch}.pooling_type` rank, as Qwen3-Reranker's converter writes)."""
    arch = header.string(GGUFKey.ARCHITECTURE, "")
    return header.integer(ArchKey.POOLING_TYPE.of(arch), None) == RANK_POOLING_TYPE
