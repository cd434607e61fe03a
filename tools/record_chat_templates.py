"""Record llama-server's renders of llama.cpp's chat templates (run by hand, never by CI):

    python3 -m tools.record_chat_templates [--server-dir DIR] [--out FILE] [--only NAME ...]

For every template of llama.cpp's `models/templates/*.jinja` (`llama_sources.template_files()`),
llama-server is started once in its `--jinja` mode with `--chat-template-file` on a tiny random
model (the tiny vocab: BOS `<bos>`, EOS `<eos>`, BOS added by the vocab), its /props read (the
template's capabilities, the build) and each message set of MESSAGE_SETS posted to /apply-template
(add_generation_prompt left at its default, true). The answers go to --out (default: this
checkout's tests/data/llama_cpp/chat_templates.json), which tests/gateway/test_chat_templates.py
renders again through `ChatTemplate.render_text`. A template llama-server refuses at start is
recorded with the end of its log; a message set it refuses, with its error.

llama-server puts today's date into some prompts (`date_string`, `strftime_now`): the record keeps
the date it ran on, and the test renders with it. Each template's prompts share a start (some
templates write a long fixed preamble), kept once as its `prefix`; a render keeps the `rest`.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import socket
import tempfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import click

from tools import _common

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tests" / "data" / "llama_cpp" / "chat_templates.json"
READY_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 30.0
LOG_TAIL_LINES = 6

_SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
MESSAGE_SETS: dict[str, list[dict[str, Any]]] = {
    "system_user": [_SYSTEM, {"role": "user", "content": "Hello!"}],
    "user": [{"role": "user", "content": "What is 2 + 2?"}],
    "multi_turn": [
        _SYSTEM,
        {"role": "user", "content": "Hi there."},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
    "multi_turn_no_system": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one."},
        {"role": "assistant", "content": "Green."},
        {"role": "user", "content": "And one more."},
    ],
    "whitespace": [
        {"role": "system", "content": "  Be brief.\n"},
        {"role": "user", "content": "  padded question \n"},
        {"role": "assistant", "content": "\n  an answer with spaces around it  \n\n"},
        {"role": "user", "content": "\tnext\n"},
    ],
    "unicode": [
        {"role": "system", "content": "Réponds en français. 🇫🇷"},
        {"role": "user", "content": "東京 — naïve café 😀 \"quoted\" and a \\ backslash, </s> & <tag>"},
    ],
    "reasoning_in_history": [
        {"role": "user", "content": "What is 3 * 4?"},
        {"role": "assistant", "content": "<think>\nThree fours.\n</think>\n\n12"},
        {"role": "user", "content": "And 5 * 6?"},
    ],
    "empty_assistant": [
        {"role": "user", "content": "Say nothing."},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Now say hi."},
    ],
    "content_parts": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "first part"}, {"type": "text", "text": "second part"}]},
    ],
}
"""The messages each template renders: OpenAI messages the gateway accepts (system, user and assistant
text), every set ending with a user turn so that add_generation_prompt applies."""


def _free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _tiny_model(directory: Path) -> Path:
    """The tiny random llama every template is served with (the tiny vocab's BOS and EOS)."""
    from skippy_zmq.testing.tiny import write_tiny_model

    return write_tiny_model(directory / "tiny-llama.gguf", arch="llama", n_layer=1, n_embd=32, n_head=2,
                            n_head_kv=1, n_ff=32)


def record_template(server: _common.LlamaServer, model: Path, template: Path, directory: Path) -> dict[str, Any]:
    """One template's record: llama-server's capabilities and a render (or error) per message set, or
    why it refused to start."""
    port = _free_port()
    log = directory / f"{template.stem}.log"
    options = ["--jinja", "--chat-template-file", str(template), "--no-webui"]
    command = server.command(model, port, threads=1, ctx_size=512, parallel=1, options=options)
    url = f"http://127.0.0.1:{port}"
    record: dict[str, Any] = {"sha256": hashlib.sha256(template.read_bytes()).hexdigest()}
    with _common.running(command, log=log, env=server.environment()) as process:
        try:
            _common.wait_healthy(url, process, READY_TIMEOUT_S, name=f"llama-server ({template.name})", log=log)
        except _common.ToolError:
            lines = log.read_text(errors="replace").splitlines()
            record["refused"] = "\n".join(line for line in lines if "error" in line.lower())[-2000:] or "\n".join(
                lines[-LOG_TAIL_LINES:])
            return record
        status, props = _common.http_get(url + "/props", REQUEST_TIMEOUT_S)
        if status != 200:
            raise _common.ToolError(f"{url}/props answered {status}: {props[:200]}")
        about = json.loads(props)
        record["build_info"] = about.get("build_info")
        record["caps"] = about.get("chat_template_caps")
        renders: dict[str, Any] = {}
        for name, messages in MESSAGE_SETS.items():
            status, answer = _common.post_json(url + "/apply-template", {"messages": messages}, REQUEST_TIMEOUT_S)
            if status == 200 and isinstance(answer, dict) and isinstance(answer.get("prompt"), str):
                renders[name] = {"prompt": answer["prompt"]}
            else:
                error = answer.get("error", answer) if isinstance(answer, dict) else answer
                message = error.get("message", error) if isinstance(error, dict) else error
                renders[name] = {"error": f"{status}: {message}"}
        record.update(_shared_prefix(renders))
    return record


def _shared_prefix(renders: dict[str, Any]) -> dict[str, Any]:
    """`prefix`, the start every rendered prompt shares (a long fixed preamble is stored once), and the
    renders with `rest` after it in place of `prompt`."""
    prompts = [r["prompt"] for r in renders.values() if "prompt" in r]
    prefix = os.path.commonprefix(prompts) if len(prompts) > 1 else ""  # noqa: RUF071 - texts, not paths
    return {"prefix": prefix, "renders": {
        name: {"rest": r["prompt"][len(prefix):]} if "prompt" in r else r for name, r in renders.items()}}


@click.command()
@click.option("--server-dir", type=click.Path(file_okay=False), default=None,
              help=f"llama-server's build directory (default: ${_common.LLAMA_SERVER_DIR_ENV}, else PATH)")
@click.option("--out", type=click.Path(dir_okay=False), default=str(DEFAULT_OUT), show_default=True)
@click.option("--only", multiple=True, help="record only these templates (file names without .jinja)")
@click.option("--quiet", is_flag=True)
def main(server_dir: str | None, out: str, only: Sequence[str], quiet: bool) -> None:
    """Record llama-server's /apply-template answers for every llama.cpp chat template into OUT."""
    from skippy_zmq.testing.llama_sources import template_files

    say = _common.progress(quiet)
    server = _common.LlamaServer.find(server_dir)
    templates = [t for t in template_files() if not only or t.stem in only]
    if not templates:
        raise _common.ToolError(f"no template named {', '.join(only)} among llama.cpp's models/templates/")
    records: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="record-chat-templates-") as scratch:
        directory = Path(scratch)
        model = _tiny_model(directory)
        day = datetime.date.today()
        for k, template in enumerate(templates):
            records[template.stem] = record_template(server, model, template, directory)
            outcome = "refused" if "refused" in records[template.stem] else "recorded"
            say(f"[{k + 1}/{len(templates)}] {template.stem}: {outcome}")
        if datetime.date.today() != day:
            raise _common.ToolError("the date changed during the run, so dated prompts disagree: run it again")
    builds = sorted({r["build_info"] for r in records.values() if r.get("build_info")})
    data = {
        "llama_cpp": {"llama_cpp_python": metadata.version("llama-cpp-python"), "build_info": builds},
        "date": day.isoformat(),
        "vocab": {"bos_token": "<bos>", "eos_token": "<eos>", "add_bos": True, "add_eos": False},
        "message_sets": MESSAGE_SETS,
        "templates": records,
    }
    Path(out).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    say(f"wrote {out} ({Path(out).stat().st_size / 1024:.0f} KiB, {len(records)} templates)")


if __name__ == "__main__":
    main()
