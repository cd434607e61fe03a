"""`bench constraints`: what constrained decoding costs, in this process, on a model's vocabulary.

Three figures: the time the final stage takes to build llguidance's token trie of the vocabulary
(once per process), the time to compile each of a set of typical schemas (and again, when it
comes from the cache), and a whole-model decode step of N sessions through a real `StageCore`
(forward, head, sampling) with every session constrained and with none, alternating rounds so
both see the same machine.
"""

from __future__ import annotations

import itertools
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from skippy_zmq.bench.report import Report, cell, markdown_table
from skippy_zmq.tokens.constraint import Constraint

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age", "email"],
               "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                              "email": {"type": "string", "format": "email"}}},
    "order": {"type": "object", "required": ["id", "items", "total"], "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"}, "total": {"type": "number"},
        "items": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["sku", "qty"],
                                                           "properties": {"sku": {"type": "string"},
                                                                          "qty": {"type": "integer"}}}},
        "status": {"enum": ["open", "paid", "shipped"]}}},
    "tool-call": {"type": "object", "required": ["name", "arguments"], "properties": {
        "name": {"enum": ["get_weather", "search", "send_mail"]},
        "arguments": {"anyOf": [
            {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
             "required": ["city"]},
            {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
             "required": ["query"]},
            {"type": "object", "properties": {"to": {"type": "string"}, "body": {"type": "string"}},
             "required": ["to", "body"]}]}}},
}
"""Typical schemas: a flat record, nested arrays of objects with a pattern, a tool call's choice."""
STEP_SCHEMA: dict[str, Any] = {"type": "object", "required": ["notes"], "properties": {
    "notes": {"type": "array", "minItems": 64, "items": {"type": "string", "minLength": 8}}}}
"""The decode steps' constraint: long enough that no session completes within the steps measured."""
PROMPT = "Write notes about the weather in JSON: "


@attrs.frozen
class ConstraintBench:
    """What `bench constraints` was asked for."""

    model: Path
    sessions: int = 16
    steps: int = 16
    rounds: int = 3
    threads: int = 2


@attrs.frozen
class StepFigures:
    """Median whole-model decode step of `sessions` sessions, constrained and not."""

    sessions: int
    plain_s: float
    constrained_s: float

    @property
    def overhead(self) -> float:
        """The constrained step's extra time, as a share of the plain one."""
        return self.constrained_s / self.plain_s - 1.0


class DecodeLoop:
    """A whole-model final stage (`StageCore` over a `StageRuntime`) driven by hand: configure,
    prefill and decode steps of many sessions, each step one batch as a stage runs it."""

    def __init__(self, core: Any, tokenizer: Any, sessions: int) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.sessions = sessions
        self._next_id = 1

    @classmethod
    def build(cls, model: Path, sessions: int, threads: int, book: Any, ctx_size: int = 512) -> DecodeLoop:
        """Load every layer of `model` on the environment's kernel with `threads`; `book` compiles constraints."""
        from skippy_zmq.config import TopologyConfig
        from skippy_zmq.launch.topology import topology_toml
        from skippy_zmq.model.gguf_model import read_hparams
        from skippy_zmq.runtime.kernels import Kernel
        from skippy_zmq.runtime.stage import StageRuntime
        from skippy_zmq.stage.core import StageCore
        from skippy_zmq.tokens.tokenizer import Tokenizer

        n_layer = read_hparams(model).n_layer
        kernel = attrs.evolve(Kernel.from_environment(), threads=threads)
        runtime = StageRuntime.load(model, 0, n_layer, ctx_size=ctx_size, kernel=kernel, weight_cache=None)
        with tempfile.TemporaryDirectory(prefix="skippy-bench-") as scratch:
            path = Path(scratch) / "topology.toml"
            path.write_text(topology_toml(model=str(model), ranges=[(0, n_layer)], topology_id="bench-constraints",
                                          lane_count=sessions, ctx_size=ctx_size, n_layer=n_layer))
            topology = TopologyConfig.from_toml(path)
        core = StageCore(topology, topology.stages[0], runtime, eog_ids=book.eog_ids, grammars=book)
        return cls(core, Tokenizer.from_gguf(model), sessions)

    def run(self, prompt: str, steps: int, constraint: Constraint | None) -> list[float]:
        """Seconds of each of `steps` decode batches of every session (sampled at temperature 0.8)."""
        from skippy_zmq.tokens.sampling import SamplingParams
        from skippy_zmq.wire.messages import MessageKind
        from skippy_zmq.wire.options import GenerationOptions

        ids = self.tokenizer.encode(prompt)
        sessions = list(range(self._next_id, self._next_id + self.sessions))
        self._next_id += self.sessions
        for session in sessions:
            options = GenerationOptions(SamplingParams(temperature=0.8, seed=session), constraint=constraint)
            self._batch([_message(MessageKind.CONFIGURE_GENERATION, session, len(ids), options=options)])
        last = self._batch([_message(MessageKind.PREFILL_FINAL_EMBD, s, len(ids), tokens=ids) for s in sessions])
        times = []
        for step in range(steps):
            batch = [_message(MessageKind.DECODE_EMBD, s, len(ids), tokens=[last[s]], pos=len(ids) + step)
                     for s in sessions]
            began = time.perf_counter()
            last = self._batch(batch)
            times.append(time.perf_counter() - began)
        self._batch([_message(MessageKind.STOP, s, len(ids)) for s in sessions])
        return times

    def _batch(self, messages: list[Any]) -> dict[int, int]:
        """Run `messages` as one batch; each session's predicted token. BenchError on an error reply."""
        from skippy_zmq.errors import BenchError
        from skippy_zmq.stage.core import Answer
        from skippy_zmq.wire.messages import encode_message
        from skippy_zmq.wire.replies import ReplyKind

        inbound = [self.core.accept(encode_message(m)) for m in messages]
        answers = [o.reply for o in self.core.run(inbound) if isinstance(o, Answer)]
        bad = [a.error for a in answers if a.kind is ReplyKind.ERROR]
        if bad:
            raise BenchError(f"the stage answered an error: {bad[0]}")
        return {a.session_id: a.predicted_token for a in answers}


_request_ids = itertools.count(1)


def _message(kind: Any, session: int, prompt_tokens: int, *, tokens: Sequence[int] = (), pos: int = 0,
             options: Any = None) -> Any:
    from skippy_zmq.wire.messages import StageMessage, StateHeader

    state = StateHeader.for_kind(kind, prompt_token_count=prompt_tokens, options=options is not None)
    return StageMessage(kind=kind, pos_start=pos, token_count=len(tokens), state=state,
                        request_id=next(_request_ids), session_id=session, tokens=list(tokens), options=options)


def compile_times(book: Any, progress: Callable[[str], None]) -> list[tuple[str, float, float]]:
    """(schema, first compile s, repeated s) of each typical schema: the repeat comes from the cache."""
    rows = []
    for name, schema in SCHEMAS.items():
        constraint = Constraint.json_schema(schema)
        began = time.perf_counter()
        constraint.check()  # the gateway's check, as a request meets it first
        book.start(constraint)
        first = time.perf_counter() - began
        began = time.perf_counter()
        book.start(constraint)
        rows.append((name, first, time.perf_counter() - began))
        progress(f"schema {name}: {first * 1e3:.1f} ms, repeated {rows[-1][2] * 1e3:.2f} ms")
    return rows


def step_times(options: ConstraintBench, book: Any, progress: Callable[[str], None]) -> StepFigures:
    """Alternating rounds of `steps` decode steps of all sessions, constrained and not."""
    loop = DecodeLoop.build(options.model, options.sessions, options.threads, book)
    for constraint in (None, Constraint.json_schema(STEP_SCHEMA)):  # graphs built, caches warm: not measured
        loop.run(PROMPT, 2, constraint)
    plain: list[float] = []
    constrained: list[float] = []
    for round_index in range(options.rounds):
        for constraint, times in ((None, plain), (Constraint.json_schema(STEP_SCHEMA), constrained)):
            times.extend(loop.run(PROMPT, options.steps, constraint))
        progress(f"round {round_index + 1}: plain {statistics.median(plain) * 1e3:.1f} ms, constrained "
                 f"{statistics.median(constrained) * 1e3:.1f} ms a step")
    return StepFigures(options.sessions, statistics.median(plain), statistics.median(constrained))


def run_constraint_bench(options: ConstraintBench, report: Report, progress: Callable[[str], None]
                         ) -> tuple[float, list[tuple[str, float, float]], StepFigures]:
    """Build the trie, compile the schemas, time the steps; one report row."""
    from skippy_zmq.tokens.grammar import GrammarBook
    from skippy_zmq.tokens.tokenizer import eog_ids_of

    book = GrammarBook(options.model, sorted(eog_ids_of(options.model)))
    before = _rss_mib()
    began = time.perf_counter()
    book.tokenizer()
    trie_s = time.perf_counter() - began
    trie_mib = _rss_mib() - before
    progress(f"token trie of {book.tokenizer().vocab_size} ids: {trie_s:.2f} s, {trie_mib:.0f} MiB")
    compiles = compile_times(book, progress)
    steps = step_times(options, book, progress)
    report.add({"model": str(options.model), "threads": options.threads, "trie_s": round(trie_s, 3),
                "trie_mib": round(trie_mib, 1),
                "compile_ms": {name: round(first * 1e3, 2) for name, first, _ in compiles},
                "repeated_ms": {name: round(again * 1e3, 3) for name, _, again in compiles},
                "sessions": steps.sessions, "steps": options.steps, "rounds": options.rounds,
                "plain_step_ms": round(steps.plain_s * 1e3, 2),
                "constrained_step_ms": round(steps.constrained_s * 1e3, 2),
                "overhead": round(steps.overhead, 4)})
    return trie_s, compiles, steps


def _rss_mib() -> float:
    """This process's resident memory, MiB (Linux)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def constraint_table(trie_s: float, compiles: Sequence[tuple[str, float, float]], steps: StepFigures) -> str:
    """The figures as a markdown table."""
    rows = [["token trie of the vocabulary (once per process)", cell(trie_s * 1e3, 0) + " ms"]]
    rows += [[f"compile schema `{name}` (repeated)", f"{cell(first * 1e3, 1)} ms ({cell(again * 1e3, 2)} ms)"]
             for name, first, again in compiles]
    rows += [[f"decode step, {steps.sessions} sessions, none constrained", cell(steps.plain_s * 1e3, 1) + " ms"],
             [f"decode step, {steps.sessions} sessions, all constrained", cell(steps.constrained_s * 1e3, 1) + " ms"],
             ["constraint overhead", f"{steps.overhead * 100:+.1f} %"]]
    return markdown_table(["what", "time"], rows, "lr")
