"""Google Cloud Vertex AI's prediction protocol (docs/PROTOCOL.md §9.8), as llama-server serves it under
`AIP_MODE=PREDICTION`: one POST route takes `{"instances": [...]}`, each instance a request to another
route named by its `@requestFormat` (`chatCompletions`, `completions`, `embeddings`, ... or the route's
path), and answers `{"predictions": [...]}`, one answer (or `{"error": ...}`) per instance in order;
socket-free.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from skippy_zmq.gateway.openai_api import ApiError
from skippy_zmq.gateway.request_json import json_kind

MAX_INSTANCES = 128
"""Instances one prediction request may carry (llama-server's limit)."""
FORMAT_FIELD = "@requestFormat"


def request_format(path: str) -> str:
    """The camelCase name of a route's path, as `@requestFormat` gives it (`/v1/chat/completions` ->
    `chatCompletions`, `/apply-template` -> `applyTemplate`)."""
    words = [word for word in re.split(r"[/_-]", path.removeprefix("/v1")) if word]
    return "".join(word if k == 0 else word[:1].upper() + word[1:] for k, word in enumerate(words))


def format_table(paths: Iterable[str]) -> dict[str, str]:
    """`@requestFormat` names and paths -> the path they name (the first path of a name wins, and a path
    is its own name)."""
    table: dict[str, str] = {}
    for path in paths:
        table.setdefault(request_format(path), path)
        table.setdefault(path, path)
    return table


def instances_of(body: Any) -> list[Any]:
    """The `instances` of a prediction request; ApiError 400 naming what is wrong."""
    if not isinstance(body, dict):
        raise ApiError.invalid(None, f"the request body must be a JSON object, got {json_kind(body)}")
    instances = body.get("instances")
    if not isinstance(instances, list):
        raise ApiError.invalid("instances", f"instances must be an array of requests, got {json_kind(instances)}")
    if len(instances) > MAX_INSTANCES:
        raise ApiError.invalid("instances", f"instances holds {len(instances)} requests; at most {MAX_INSTANCES}")
    return instances


def instance_request(instance: Any, index: int, formats: Mapping[str, str]) -> tuple[str, bytes]:
    """The route and JSON body one instance asks for (`stream` off: an answer is one JSON value); ApiError
    400 naming the instance."""
    where = f"instances[{index}]"
    if not isinstance(instance, dict):
        raise ApiError.invalid(where, f"{where} must be a JSON object, got {json_kind(instance)}")
    name = instance.get(FORMAT_FIELD)
    if not isinstance(name, str):
        raise ApiError.invalid(f"{where}.{FORMAT_FIELD}", f"{where} needs a string {FORMAT_FIELD} naming the route "
                               "(e.g. chatCompletions)")
    path = formats.get(name)
    if path is None:
        known = ", ".join(sorted(key for key in formats if not key.startswith("/")))
        raise ApiError.invalid(f"{where}.{FORMAT_FIELD}", f"{where}: no route for {FORMAT_FIELD} {name!r}; "
                               f"known: {known}")
    payload = {key: value for key, value in instance.items() if key != FORMAT_FIELD}
    if "stream" in payload:
        payload["stream"] = False
    return path, json.dumps(payload, ensure_ascii=False).encode("utf-8")
