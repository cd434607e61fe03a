"""`generate`: run a list of prompts through a pipeline, a running topology or a local one started
for the call, and yield their results.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs

from skippy_zmq import defaults
from skippy_zmq.config import TopologyConfig, cache_type_validator
from skippy_zmq.driver.generation import GenerationRequest, GenerationResult
from skippy_zmq.driver.settings import SchedulerSettings
from skippy_zmq.driver.transport import PipelineTransport, TextCallback
from skippy_zmq.errors import ConfigError, SkippyError
from skippy_zmq.link import LinkShape
from skippy_zmq.tokens.constraint import Constraint, ConstraintError, ConstraintKind
from skippy_zmq.tokens.sampling import SamplingParams
from skippy_zmq.tokens.tokenizer import Tokenizer


@attrs.frozen
class GenerateOptions:
    """Everything `skippy-zmq generate` needs, parsed."""

    prompts: tuple[str, ...]
    topology_path: str | None = None
    model: str | None = None
    stages: int = 3
    cache_type_k: str = attrs.field(default=defaults.CACHE_TYPE, validator=cache_type_validator)  # local pipeline
    cache_type_v: str = attrs.field(default=defaults.CACHE_TYPE, validator=cache_type_validator)
    codec: str = "raw-f32-v1"
    codec_policy: str = "fixed"
    prefill_chunk: int = defaults.PREFILL_CHUNK
    timeout_s: float = defaults.REPLY_TIMEOUT_S  # of each reply
    ready_timeout_s: float = defaults.READY_TIMEOUT_S
    recovery_timeout_s: float = defaults.RECOVERY_TIMEOUT_S
    max_tokens: int = 64
    temperature: float = defaults.TEMPERATURE
    top_k: int = defaults.TOP_K
    top_p: float = defaults.TOP_P
    min_p: float = defaults.MIN_P
    repeat_penalty: float = defaults.REPEAT_PENALTY
    repeat_last_n: int = defaults.REPEAT_LAST_N
    seed: int = 0
    stops: tuple[str, ...] = ()
    verbose: bool = False
    log_json: bool = False  # the stages' relayed lines as JSON (with verbose), else plain
    check_tensors: bool = False  # the local pipeline's stages scan their tensors at load
    max_stage_memory: int | None = None  # bytes per local stage; None: the host's available memory shared
    emulate_link: LinkShape | None = None  # every link of the local pipeline, emulated (docs/ARCHITECTURE.md)
    constraint: Constraint | None = None  # what every text must match (docs/PROTOCOL.md §5, Constrained sessions)
    # n-gram drafts a decode step may carry (None: as the stages' numerics allow; docs/PROTOCOL.md §6, Speculative
    # decoding)
    draft_max: int | None = None
    scheduler: SchedulerSettings = attrs.field(init=False)  # the scheduler's share of these, built once

    @scheduler.default
    def _scheduler(self) -> SchedulerSettings:
        return SchedulerSettings(prefill_chunk=self.prefill_chunk, reply_timeout_s=self.timeout_s,
                                 recovery_timeout_s=self.recovery_timeout_s, draft_max=self.draft_max)

    def sampling(self) -> SamplingParams:
        """The sampling settings every session gets."""
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repeat_penalty=self.repeat_penalty,
            penalty_last_n=self.repeat_last_n,
            seed=self.seed,
        )

    def requests(self) -> list[GenerationRequest]:
        """One request per prompt."""
        sampling = self.sampling()
        return [
            GenerationRequest(prompt=p, max_tokens=self.max_tokens, sampling=sampling, stop=self.stops,
                              constraint=self.constraint)
            for p in self.prompts
        ]


CONSTRAINT_OPTIONS: dict[str, ConstraintKind] = {
    "grammar": ConstraintKind.GBNF, "json_schema": ConstraintKind.JSON_SCHEMA, "regex": ConstraintKind.REGEX,
}
"""`generate`'s constraint options (llama.cpp's names) and the language each gives."""


def constraint_of(given: Mapping[str, str | None]) -> Constraint | None:
    """The constraint `generate` was given (at most one of CONSTRAINT_OPTIONS, its text or, with a
    leading @, a file's), checked; ConfigError naming the option and where the text is wrong."""
    named = [(name, text) for name, text in given.items() if text is not None]
    if len(named) > 1:
        raise ConfigError(f"--{named[0][0].replace('_', '-')} and --{named[1][0].replace('_', '-')} both constrain "
                          "the text; give one of them")
    if not named:
        return None
    name, text = named[0]
    option = f"--{name.replace('_', '-')}"
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{option} {text}: cannot read the file: {exc}") from None
    try:
        constraint = Constraint(CONSTRAINT_OPTIONS[name], text)
        constraint.check()
    except ConstraintError as exc:
        raise ConfigError(f"{option}: {exc}") from None
    return constraint


def run_generate(
    options: GenerateOptions,
    on_text: TextCallback | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[GenerationResult]:
    """Generate through running workers (`topology_path`) or a local pipeline started for it;
    `progress` hears about stages starting."""
    import sys

    from skippy_zmq.launch.processes import LocalPipeline
    from skippy_zmq.launch.topology import write_local_topology
    from skippy_zmq.model.catalog import GEMMA3_270M_ALIAS, resolve_model
    from skippy_zmq.model.gguf_model import ModelHParams

    if options.topology_path is not None:
        if options.check_tensors:
            raise ConfigError(f"check_tensors applies to a local pipeline; the stages of {options.topology_path} "
                              "run already: start their workers with --check-tensors")
        topology = TopologyConfig.from_toml(options.topology_path)
        tokenizer = Tokenizer.from_gguf(resolve_model(topology.model))
        return _drive(topology, tokenizer, options, on_text, progress)
    model = options.model or GEMMA3_270M_ALIAS
    model_path = resolve_model(model)
    hparams = ModelHParams.from_gguf(model_path)
    tokenizer = Tokenizer.from_gguf(model_path)
    with tempfile.TemporaryDirectory(prefix="skippy-zmq-") as directory:
        path = write_local_topology(
            str(model_path), hparams.n_layer, options.stages, codec=options.codec,
            policy=options.codec_policy, directory=Path(directory), max_stage_memory=options.max_stage_memory,
            cache_type_k=options.cache_type_k, cache_type_v=options.cache_type_v, emulate_link=options.emulate_link,
        )
        with LocalPipeline(path, log_sink=sys.stderr if options.verbose else None, progress=progress,
                           log_json=options.log_json, check_tensors=options.check_tensors) as pipeline:
            try:
                # Nothing restarts this pipeline's stages: a failure fails at once, no recovery wait.
                local = attrs.evolve(options, recovery_timeout_s=0.0)
                return _drive(pipeline.topology, tokenizer, local, on_text, progress)
            except SkippyError as exc:
                dead = pipeline.dead()
                if dead:
                    raise type(exc)(f"{exc}; {'; '.join(p.describe_exit() for p in dead)}") from None
                raise


def _drive(
    topology: TopologyConfig, tokenizer: Tokenizer, options: GenerateOptions, on_text: TextCallback | None,
    progress: Callable[[str], None] | None = None,
) -> list[GenerationResult]:
    with PipelineTransport(topology, tokenizer, options.scheduler) as client:
        client.wait_ready(options.ready_timeout_s, progress)
        return client.generate(options.requests(), on_text)
