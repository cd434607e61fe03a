"""The `skippy-zmq` command: a thin click layer that maps SkippyError to exit status 1."""

from __future__ import annotations

import functools
import json
import secrets
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from skippy_zmq import defaults
from skippy_zmq.bench.command import bench
from skippy_zmq.errors import SkippyError
from skippy_zmq.gateway.command import (
    BATCH_INVARIANT_HELP,
    CHECK_TENSORS_HELP,
    DRAFT_MAX_HELP,
    EMULATE_LINK_HELP,
    MAX_STAGE_MEMORY_HELP,
    cache_type_options,
    check_codec_options,
    check_local_cache_types,
    check_local_options,
    default_drafts,
    link_shape,
    memory_size,
    serve,
    set_batch_invariant,
)

if TYPE_CHECKING:
    from skippy_zmq.driver.generate import GenerateOptions
    from skippy_zmq.driver.generation import GenerationResult
    from skippy_zmq.link import LinkShape

F = TypeVar("F", bound=Callable[..., Any])


def _fail(exc: BaseException, *, as_json: bool = False, component: str = "skippy-zmq") -> NoReturn:
    """Say why the command failed (a plain line, or a `fatal` JSON event) and exit 1."""
    if as_json:
        from skippy_zmq.telemetry import EventLog

        EventLog(component).emit("fatal", error=str(exc))
    else:
        click.echo(f"error: {exc}", err=True)
    sys.exit(1)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="skippy-zmq")
def main() -> None:
    """Pipeline-parallel LLM stage workers chained by ZeroMQ."""


@main.command()
@click.option("--topology", "topology_path", required=True, type=click.Path(dir_okay=False), help="Topology TOML file.")
@click.option("--stage", "stage_id", required=True, help='Stage id ("stage-1") or index.')
@click.option("--ready-file", type=click.Path(dir_okay=False), default=None,
              help="Create this file once the stage serves; touched at every heartbeat (health checks).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="BLAS threads (default: $OPENBLAS_NUM_THREADS, else 1).")
@click.option("--log-json", is_flag=True, help="Log one JSON object per line instead of plain lines.")
@click.option("--check-tensors", is_flag=True, help=CHECK_TENSORS_HELP)
@click.option("--emulate-link", default=None, callback=link_shape, metavar="SPEC",
              help=EMULATE_LINK_HELP + " Overrides the topology's emulate_link for this stage.")
@click.option("--batch-invariant/--no-batch-invariant", default=None, help=BATCH_INVARIANT_HELP)
def worker(topology_path: str, stage_id: str, ready_file: str | None, threads: int | None, log_json: bool,
           check_tensors: bool, emulate_link: LinkShape | None, batch_invariant: bool | None) -> None:
    """Serve one stage: load its layers, bind its PULL socket, run until SIGTERM/SIGINT."""
    _set_blas_threads(threads)
    set_batch_invariant(batch_invariant)
    from skippy_zmq.config import TopologyConfig
    from skippy_zmq.stage.worker import run_stage
    from skippy_zmq.telemetry import EventLog

    log = EventLog(f"stage {stage_id}", json_lines=log_json)
    try:
        topology = TopologyConfig.from_toml(topology_path)
        key: str | int = int(stage_id) if stage_id.isdigit() else stage_id
        log.component = topology.stage(key).stage_id
        sys.exit(run_stage(topology, key, log=log, ready_file=ready_file, check_tensors=check_tensors,
                           link=emulate_link))
    except SkippyError as exc:
        log.emit("fatal", error=str(exc))
        _fail(exc)


def _set_blas_threads(threads: int | None) -> None:
    """Pin BLAS threads before numpy loads: several stages share a few cores, and OpenBLAS's
    threaded small matmuls collapse when another process holds a core (docs/BENCHMARKS.md)."""
    import os

    value = str(threads) if threads is not None else os.environ.get("OPENBLAS_NUM_THREADS", "1")
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if threads is not None or name not in os.environ:
            os.environ[name] = value
    if "numpy" in sys.modules and threads is not None:
        click.echo("warning: numpy was already imported; --threads may not take effect", err=True)


def _sampling_options(func: F) -> F:
    options = [
        click.option("--max-tokens", type=click.IntRange(min=0), default=64, show_default=True,
                     help="Tokens to generate per prompt."),
        click.option("--temperature", type=click.FloatRange(min=0), default=defaults.TEMPERATURE, show_default=True,
                     help="0 means greedy."),
        click.option("--top-k", type=click.IntRange(min=0), default=defaults.TOP_K, show_default=True,
                     help="0 disables."),
        click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=defaults.TOP_P, show_default=True,
                     help="1 disables."),
        click.option("--min-p", type=click.FloatRange(0, 1), default=defaults.MIN_P, show_default=True,
                     help="0 disables."),
        click.option("--repeat-penalty", type=click.FloatRange(min=0, min_open=True), default=defaults.REPEAT_PENALTY,
                     show_default=True, help="1 disables."),
        click.option("--repeat-last-n", type=click.IntRange(min=0), default=defaults.REPEAT_LAST_N, show_default=True,
                     help="Tokens the repeat penalty looks back over."),
        click.option("--seed", type=click.IntRange(0, 2**64 - 1), default=None,
                     help="Sampling seed (default: random, reported in --json)."),
        click.option("--stop", "stops", multiple=True, help="Stop generating when this text appears (repeatable)."),
        click.option("--grammar", default=None, metavar="GBNF",
                     help="Constrain every text to this GBNF grammar (llama.cpp's syntax; @FILE reads a file)."),
        click.option("--json-schema", default=None, metavar="SCHEMA",
                     help="Constrain every text to JSON matching this schema (@FILE reads a file)."),
        click.option("--regex", default=None, metavar="PATTERN",
                     help="Constrain every text to this regular expression."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


@main.command()
@click.argument("prompts", nargs=-1)
@click.option("--prompts-file", type=click.File("r"), help="One prompt per line (in addition to PROMPTS).")
@click.option("--topology", "topology_path", type=click.Path(dir_okay=False),
              help="Talk to workers already running for this topology.")
@click.option("--model", default=None, help="GGUF path for a local pipeline (default: Gemma 3 270M Q4_K_M).")
@click.option("--stages", type=click.IntRange(min=1), default=3, show_default=True,
              help="Stages of the local pipeline.")
@cache_type_options
@click.option("--codec", default="raw-f32-v1", show_default=True, help="Activation codec of the local pipeline.")
@click.option("--codec-policy", default="fixed", show_default=True, help="fixed or auto-lossless-v1.")
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=defaults.PREFILL_CHUNK, show_default=True,
              help="Prompt tokens per prefill message.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=defaults.REPLY_TIMEOUT_S,
              show_default=True, help="Deadline of each reply, seconds.")
@click.option("--ready-timeout", "ready_timeout_s", type=click.FloatRange(min=0, min_open=True),
              default=defaults.READY_TIMEOUT_S, show_default=True,
              help="How long to wait for every stage's first heartbeat, seconds.")
@click.option("--recovery-timeout", "recovery_timeout_s", type=click.FloatRange(min=0),
              default=defaults.RECOVERY_TIMEOUT_S,
              show_default=True,
              help="How long sessions wait for a failed stage to come back (then they replay); 0: fail at once.")
@click.option("--stats", is_flag=True, help="Print per-stage compute, encode, transfer and queue time per token.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per prompt.")
@click.option("-v", "--verbose", is_flag=True, help="Relay worker log lines to stderr.")
@click.option("--log-json", is_flag=True, help="Progress as JSON log lines (with the workers' own) on stderr.")
@click.option("--check-tensors", is_flag=True, help=CHECK_TENSORS_HELP + " Local pipeline only.")
@click.option("--max-stage-memory", default=None, callback=memory_size, help=MAX_STAGE_MEMORY_HELP)
@click.option("--emulate-link", default=None, callback=link_shape, metavar="SPEC",
              help=EMULATE_LINK_HELP + " Every link of the local pipeline.")
@click.option("--batch-invariant/--no-batch-invariant", default=None,
              help=BATCH_INVARIANT_HELP + " Local pipeline only.")
@click.option("--draft-max", type=click.IntRange(0, defaults.MAX_DRAFT_TOKENS), default=None, help=DRAFT_MAX_HELP)
@_sampling_options
def generate(
    prompts: tuple[str, ...],
    prompts_file: Any,
    topology_path: str | None,
    model: str | None,
    stages: int,
    cache_type_k: str, cache_type_v: str,
    codec: str, codec_policy: str,
    prefill_chunk: int,
    timeout_s: float, ready_timeout_s: float, recovery_timeout_s: float,
    stats: bool, as_json: bool, verbose: bool, log_json: bool,
    check_tensors: bool,
    max_stage_memory: int | None, emulate_link: LinkShape | None, batch_invariant: bool | None, draft_max: int | None,
    **sampling: Any,
) -> None:
    """Generate text for PROMPTS through a pipeline; several prompts run as concurrent sessions.

    Without --topology, a local pipeline of --stages worker processes is started on loopback
    for --model and stopped at the end. Text streams as it comes; with several prompts, each
    line of output starts with its prompt's index (`[2] ...`).
    """
    from skippy_zmq.driver.generate import GenerateOptions

    all_prompts = _all_prompts(prompts, prompts_file)
    constraint = _constraint_option(sampling)
    check_local_options(topology_path, model=model, check_tensors=check_tensors, max_stage_memory=max_stage_memory,
                        emulate_link=emulate_link)
    check_local_cache_types(topology_path)
    check_codec_options(codec, codec_policy)
    set_batch_invariant(batch_invariant)  # the local stages inherit it
    seed = sampling.pop("seed")
    options = GenerateOptions(
        prompts=tuple(all_prompts),
        topology_path=topology_path,
        model=model,
        stages=stages,
        cache_type_k=cache_type_k, cache_type_v=cache_type_v,
        codec=codec, codec_policy=codec_policy,
        prefill_chunk=prefill_chunk,
        timeout_s=timeout_s,
        ready_timeout_s=ready_timeout_s,
        recovery_timeout_s=recovery_timeout_s,
        seed=seed if seed is not None else secrets.randbits(63),
        stops=tuple(stop for stop in sampling.pop("stops") if stop),
        verbose=verbose or log_json,
        log_json=log_json,
        check_tensors=check_tensors,
        max_stage_memory=max_stage_memory, emulate_link=emulate_link, constraint=constraint,
        draft_max=default_drafts(draft_max, batch_invariant),
        **sampling,
    )
    _exit_on_sigterm()
    progress = _progress_printer(quiet=as_json and not log_json, as_json=log_json)
    if not _generate_and_print(options, progress, as_json=as_json, stats=stats):
        sys.exit(1)


def _constraint_option(options: dict[str, Any]) -> Any:
    """The constraint among `generate`'s options (taken out of them), checked; exit 1 naming what is wrong."""
    from skippy_zmq.driver.generate import CONSTRAINT_OPTIONS, constraint_of

    try:
        return constraint_of({name: options.pop(name) for name in CONSTRAINT_OPTIONS})
    except SkippyError as exc:
        _fail(exc)


def _all_prompts(prompts: tuple[str, ...], prompts_file: Any) -> list[str]:
    """The PROMPT arguments, then the non-blank lines of --prompts-file; a usage error if none."""
    all_prompts = list(prompts)
    if prompts_file is not None:
        all_prompts += [line.rstrip("\n") for line in prompts_file if line.strip()]
    if not all_prompts:
        raise click.UsageError("give at least one PROMPT or --prompts-file")
    return all_prompts


def _generate_and_print(options: GenerateOptions, progress: Callable[[str], None], *, as_json: bool,
                        stats: bool) -> bool:
    """Run `generate`, streaming text as it comes, then print the results; False when one failed."""
    from skippy_zmq.driver.generate import run_generate

    prompts = list(options.prompts)
    on_text: _Echo | _PrefixedEcho = (
        _PrefixedEcho(prompts) if len(prompts) > 1 and not as_json else _Echo(None if as_json else prompts[0])
    )
    try:
        if options.topology_path is None:
            _assemble(options.model, progress)
        results = run_generate(options, on_text=on_text, progress=progress)
    except SkippyError as exc:
        on_text.finish(failed=True)
        _fail(exc)
    except KeyboardInterrupt:
        click.echo("\ninterrupted", err=True)
        sys.exit(130)
    on_text.finish(failed=False)
    return _print_results(results, seed=options.seed, stream=on_text.streams, echoed=on_text.echoed,
                          as_json=as_json, stats=stats)


def _assemble(model: str | None, progress: Callable[[str], None]) -> None:
    """Resolve a local pipeline's model first, so an assembly of the default model is reported."""
    from skippy_zmq.model.catalog import GEMMA3_270M_ALIAS, resolve_model

    resolve_model(model or GEMMA3_270M_ALIAS, progress=progress)


def _progress_printer(*, quiet: bool, as_json: bool, component: str = "generate") -> Callable[[str], None]:
    """Progress lines on stderr: `[skippy-zmq] text`, a JSON event per line, or nothing."""
    from skippy_zmq.telemetry import EventLog

    log = EventLog(component)

    def progress(text: str) -> None:
        if as_json:
            log.emit("progress", detail=text)
        elif not quiet:
            click.echo(f"[skippy-zmq] {text}", err=True)

    return progress


class _Echo:
    """The stream of a single prompt: the prompt, then its text as it grows (None: silent)."""

    def __init__(self, prompt: str | None) -> None:
        self.prompt = prompt
        self.echoed = False

    @property
    def streams(self) -> bool:
        """Whether text is printed as it comes."""
        return self.prompt is not None

    def finish(self, *, failed: bool) -> None:
        """End a stream cut short by a failure with its line."""
        if failed and self.streams:
            click.echo()

    def __call__(self, _index: int, piece: str) -> None:
        if self.prompt is None:
            return
        if not self.echoed:
            click.echo(self.prompt, nl=False)
            self.echoed = True
        click.echo(piece, nl=False)


class _PrefixedEcho:
    """The streams of several prompts, one output line at a time, each line led by `[index] `.

    A prompt's text is printed when it holds a whole line or `width` characters (cut after a
    space when there is one), and the rest at the end; the first line starts with the prompt.
    """

    streams = True

    def __init__(self, prompts: list[str], width: int = 72) -> None:
        self.pending = list(prompts)  # per prompt: text not yet printed
        self.width = width
        self.echoed = True

    def __call__(self, index: int, piece: str) -> None:
        text = self.pending[index] + piece
        while True:
            cut = text.find("\n")
            if cut < 0 and len(text) >= self.width:
                cut = text.rfind(" ", 0, self.width) + 1 or self.width
            if cut < 0:
                break
            click.echo(f"[{index}] {text[:cut]}")
            text = text[cut + 1:] if text[cut:cut + 1] == "\n" else text[cut:]
        self.pending[index] = text

    def finish(self, *, failed: bool = False) -> None:
        """Print what every prompt still holds (`failed`: the same, the run was cut short)."""
        for index, text in enumerate(self.pending):
            if text:
                click.echo(f"[{index}] {text}")
        self.pending = [""] * len(self.pending)


def _print_results(
    results: list[GenerationResult], *, seed: int, stream: bool, echoed: bool, as_json: bool, stats: bool
) -> bool:
    """Print every result (a streamed one only ends its line, `echoed` when the prompt was
    printed before its text; several streamed prompts need nothing more); False when one failed."""
    for index, result in enumerate(results):
        if as_json:
            record = result.as_json() | {"seed": seed}
            click.echo(json.dumps(record, ensure_ascii=False))
            continue
        if stream:
            if len(results) == 1:
                click.echo("" if echoed else result.prompt)
        else:
            click.echo(f"[{index}] {result.prompt}{result.text}")
        if result.error:
            click.echo(f"error: prompt {index}: {result.error}", err=True)
        if stats:
            _print_stats(index, result.stats())
    return not any(result.error for result in results)


def _exit_on_sigterm() -> None:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so context managers stop the local workers."""
    import signal

    def _raise(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise)


def _print_stats(index: int, stats: dict[str, Any]) -> None:
    click.echo(
        f"prompt {index}: {stats['prompt_tokens']} prompt tokens, {stats['generated_tokens']} generated, "
        f"first token {stats['time_to_first_token_s']} s, decode {stats['decode_tokens_per_s']} tok/s",
        err=True,
    )
    click.echo("  stage  messages  queue_us  decode_us  compute_us  encode_us  transfer_us  bytes_out", err=True)
    for row in stats["stages"]:
        click.echo(
            f"  {row['stage_index']:>5}  {row['messages']:>8}  {row['queue_us']:>8.0f}  {row['decode_us']:>9.0f}  "
            f"{row['compute_us']:>10.0f}  {row['encode_us']:>9.0f}  {row['transfer_us']:>11.0f}  "
            f"{row['bytes_out_per_message']:>9.0f}",
            err=True,
        )


@main.command()
@click.option("--topology", "topology_path", required=True, type=click.Path(dir_okay=False), help="Topology TOML file.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=5, show_default=True,
              help="Restarts of one stage within 10 minutes before `up` gives up; 0 turns restarts off.")
@click.option("--silence", "silence_s", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="A ready stage without a heartbeat for this long is killed and restarted, seconds.")
@click.option("--ready-timeout", "ready_timeout_s", type=click.FloatRange(min=0, min_open=True),
              default=defaults.READY_TIMEOUT_S, show_default=True,
              help="How long a stage may take to get ready, seconds.")
@click.option("--log-json", is_flag=True, help="Log one JSON object per line (the stages' too) instead of plain lines.")
@click.option("--check-tensors", is_flag=True, help=CHECK_TENSORS_HELP)
@click.option("--host", default=None,
              help="Run only the stages on this host (their `host` key, else pull_connect's host, as the file "
                   "writes it): one `up` per machine of a topology over several hosts.")
@click.option("--batch-invariant/--no-batch-invariant", default=None, help=BATCH_INVARIANT_HELP)
def up(topology_path: str, max_restarts: int, silence_s: float, ready_timeout_s: float, log_json: bool,
       check_tensors: bool, host: str | None, batch_invariant: bool | None) -> None:
    """Run every stage of a topology (with --host, those of one host) locally under supervision (Ctrl-C stops all).

    A stage that dies, or whose heartbeats stop for --silence seconds (it is killed first), is
    restarted with backoff while the others keep running; drivers replay their sessions on it.
    Exits 0 after Ctrl-C or SIGTERM once the stages are up, 1 when a stage fails more than
    --max-restarts times within 10 minutes, 130 when interrupted while the stages still start.
    """
    set_batch_invariant(batch_invariant)

    from skippy_zmq.launch.processes import LocalPipeline
    from skippy_zmq.launch.supervisor import RestartPolicy
    from skippy_zmq.stage.worker import StopRequest

    stop = StopRequest()  # a flag: a handler that takes a lock can deadlock on a second signal
    _exit_on_sigterm()
    say = _progress_printer(quiet=False, as_json=log_json, component="up")
    fail = functools.partial(_fail, as_json=log_json, component="up")
    try:
        policy = RestartPolicy(max_restarts=max_restarts, silence_s=silence_s, ready_timeout_s=ready_timeout_s)
        pipeline = LocalPipeline(topology_path, log_sink=sys.stderr, progress=say, log_json=log_json,
                                 check_tensors=check_tensors, host=host)
    except SkippyError as exc:
        fail(exc)
    try:
        pipeline.start(ready_timeout_s)  # stops what it started if startup fails or is interrupted
        stop.install()
    except SkippyError as exc:
        fail(exc)
    except KeyboardInterrupt:
        pipeline.stop()
        sys.exit(130)
    say(f"{len(pipeline.processes)} stages ready; Ctrl-C stops them")
    try:
        gave_up = pipeline.supervise(lambda: stop.requested, policy)
    finally:
        pipeline.stop()
    if gave_up is not None:
        fail(SkippyError(f"stage failed: {gave_up}"))


HOSTS_HELP = ("Several hosts in pipeline order, ADDRESS=MEMORY each, comma-separated (10.0.0.1=12GiB,10.0.0.2=16GiB): "
              "one stage per entry, within that entry's memory; a host named twice runs two stages. Each stage "
              "binds 0.0.0.0 and is reached at its address; replaces --stages.")


@main.command()
@click.option("--model", required=True, help="GGUF path, or gemma3-270m-q4_k_m.")
@click.option("--stages", type=click.IntRange(min=1), default=None, help="Number of stages, all on one host.")
@click.option("--hosts", "hosts_spec", default=None, help=HOSTS_HELP)
@click.option("--driver-host", default=None,
              help="With --hosts: where the driver (serve) runs [default: the first host].")
@click.option("--host", default=None, help="With --stages: the address the stages bind on [default: 127.0.0.1].")
@click.option("--base-port", type=click.IntRange(1, 65000), default=5710, show_default=True,
              help="Driver port; stages follow.")
@click.option("--codec", default="raw-f32-v1", show_default=True)
@click.option("--codec-policy", default="auto-lossless-v1", show_default=True)
@click.option("--lanes", type=click.IntRange(min=1), default=8, show_default=True,
              help="Concurrent sessions each stage holds (its KV cache is sized for them).")
@click.option("--ctx-size", type=click.IntRange(min=2), default=defaults.CTX_SIZE, show_default=True,
              help="Positions per session.")
@click.option("--max-stage-memory", default=None, callback=memory_size, help=MAX_STAGE_MEMORY_HELP)
@click.option("--curve/--no-curve", default=None,
              help="CurveZMQ on every link, keys under keys/ beside the file [default: on with --hosts, off else].")
@cache_type_options
def plan(model: str, stages: int | None, hosts_spec: str | None, driver_host: str | None, host: str | None,
         base_port: int, codec: str, codec_policy: str, lanes: int, ctx_size: int, max_stage_memory: int | None,
         curve: bool | None, cache_type_k: str, cache_type_v: str) -> None:
    """Print a balanced topology TOML for MODEL cut into --stages stages, or one stage per --hosts entry.

    The cut minimizes the busiest stage's cost per decode step among the cuts whose every stage
    fits its memory (weights, KV cache at --ctx-size and --lanes, graph buffers, the process);
    costs are the file's bytes a decode step of --lanes rows reads for the default quantized kernel
    (of an expert file's layers, only the experts those rows pick), else measured per model
    (`python3 -m tools.measure_costs`) or estimated from float32 weight sizes. The TOML starts with
    comments giving the cost model and each stage's predicted cost and memory; with --hosts, also
    the commands to run next on each host and the ports to open.
    """
    if (stages is None) == (hosts_spec is None):
        raise click.UsageError("give --stages N (one host) or --hosts ADDRESS=MEMORY,... (several), not both")
    if hosts_spec is not None:
        for name, value in (("--host", host), ("--max-stage-memory", max_stage_memory)):
            if value is not None:
                raise click.UsageError(f"{name} applies to --stages; with --hosts each stage binds 0.0.0.0 and "
                                       "holds at most its host's memory")
        text = _plan_hosts(model, hosts_spec, driver_host=driver_host, base_port=base_port, codec=codec,
                           policy=codec_policy, lanes=lanes, ctx_size=ctx_size, curve=curve is not False,
                           cache_type_k=cache_type_k, cache_type_v=cache_type_v)
    else:
        assert stages is not None
        if driver_host is not None:
            raise click.UsageError("--driver-host applies to --hosts")
        text = _plan_stages(model, stages, host=host or "127.0.0.1", base_port=base_port, codec=codec,
                            policy=codec_policy, lanes=lanes, ctx_size=ctx_size, max_stage_memory=max_stage_memory,
                            curve=curve is True, cache_type_k=cache_type_k, cache_type_v=cache_type_v)
    click.echo(text, nl=False)


def _plan_hosts(model: str, spec: str, *, driver_host: str | None, base_port: int, codec: str, policy: str,
                lanes: int, ctx_size: int, curve: bool, cache_type_k: str, cache_type_v: str) -> str:
    """`plan --hosts`: the topology text, or exit 1 naming what is wrong."""
    from skippy_zmq.launch.hosts import DEFAULT_KEYS_DIR, HostEntry, hosts_topology

    try:
        return hosts_topology(model, HostEntry.parse_list(spec), driver_host=driver_host, base_port=base_port,
                              codec=codec, policy=policy, lane_count=lanes, ctx_size=ctx_size,
                              cache_type_k=cache_type_k, cache_type_v=cache_type_v,
                              keys_dir=DEFAULT_KEYS_DIR if curve else None)
    except SkippyError as exc:
        _fail(exc)


def _plan_stages(model: str, stages: int, *, host: str, base_port: int, codec: str, policy: str, lanes: int,
                 ctx_size: int, max_stage_memory: int | None, curve: bool, cache_type_k: str,
                 cache_type_v: str) -> str:
    """`plan --stages`: the topology text, or exit 1 naming what is wrong."""
    from skippy_zmq.config import TopologyConfig
    from skippy_zmq.launch.hosts import DEFAULT_KEYS_DIR
    from skippy_zmq.launch.topology import plan_local, topology_toml
    from skippy_zmq.model.catalog import resolve_model
    from skippy_zmq.model.gguf_model import ModelHParams

    try:
        path = resolve_model(model)
        hparams = ModelHParams.from_gguf(path)
        cut = plan_local(str(path), hparams.n_layer, stages, lane_count=lanes, ctx_size=ctx_size,
                         max_stage_memory=max_stage_memory, cache_type_k=cache_type_k, cache_type_v=cache_type_v)
        limits = cut.limits.limits if cut.limits is not None else None
        text = cut.describe() + "\n" + topology_toml(
            model=model if model != str(path) else str(Path(path).resolve()),
            ranges=cut.ranges,
            topology_id=f"{Path(str(path)).stem}-{stages}stage",
            ports=[base_port + i for i in range(stages + 1)],
            host=host,
            codec=codec,
            policy=policy,
            n_layer=hparams.n_layer,
            lane_count=lanes,
            ctx_size=ctx_size,
            max_memory=limits if max_stage_memory is not None else None,
            cache_type_k=cache_type_k,
            cache_type_v=cache_type_v,
            keys_dir=DEFAULT_KEYS_DIR if curve else None,
        )
        TopologyConfig.from_toml_text(text, source="<plan>")
    except SkippyError as exc:
        _fail(exc)
    return text


@main.command()
@click.option("--topology", "topology_path", required=True, type=click.Path(dir_okay=False), help="Topology TOML file.")
@click.option("--client", "client_name", default=None,
              help="Make a request-API client pair NAME and admit its public key (clients_dir).")
@click.option("--bundles", "bundles_dir", type=click.Path(file_okay=False), default=None,
              help="Then write DIR/HOST/ for each host of the topology: the file, every public key, and the "
                   "secrets of only that host's stages (and the driver's on its host).")
def keygen(topology_path: str, client_name: str | None, bundles_dir: str | None) -> None:
    """Create the CURVE key pairs a topology's [security] table asks for (existing keys are kept).

    Without --client: a pair for the driver and for every stage that lacks one, under
    keys_dir (public/NAME.key, secret/NAME.key_secret readable by the owner only). With
    --client NAME: a pair under keys_dir/clients/ whose public key is copied into clients_dir.
    With --bundles DIR, the keys are then split per host (stages placed by their `host` key, else
    pull_connect's host) into DIR/HOST/, laid out as the topology's folder and keys_dir are, so a
    copy of DIR/HOST/ in a working directory on HOST runs `up --topology ... --host HOST` there.
    """
    if client_name is not None and bundles_dir is not None:
        raise click.UsageError("--client and --bundles are separate steps; run keygen once for each")
    from skippy_zmq.config import TopologyConfig
    from skippy_zmq.security.keys import KeyStore, key_names
    from skippy_zmq.security.keys import keygen as make_keys

    try:
        topology = TopologyConfig.from_toml(topology_path)
        store = KeyStore.of(topology.security, topology.source)
        if client_name is not None:
            public, secret, admitted = store.ensure_client(client_name)
            click.echo(f"client {client_name}: public {public}, secret {secret}; admitted as {admitted}")
            return
        created = make_keys(topology)
    except SkippyError as exc:
        _fail(exc)
    for name in key_names(topology):
        state = "created" if name in created else "kept"
        click.echo(f"{name}: {state} ({store.public_path(name)}, {store.secret_path(name)})")
    if bundles_dir is not None:
        from skippy_zmq.security.bundles import write_bundles

        try:
            bundles = write_bundles(Path(topology_path), topology, Path(bundles_dir))
        except SkippyError as exc:
            _fail(exc)
        for bundle in bundles:
            click.echo(f"bundle {bundle.describe()}")


@main.command()
@click.option("--model", required=True, help="GGUF path, or gemma3-270m-q4_k_m.")
@click.argument("text")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of ids.")
@click.option("--no-bos", is_flag=True, help="Add nothing around the text (no BOS, no EOS) even if the vocab asks.")
def tokenize(model: str, text: str, as_json: bool, no_bos: bool) -> None:
    """Print the token ids of TEXT under MODEL's tokenizer."""
    from skippy_zmq.model.catalog import resolve_model
    from skippy_zmq.tokens.tokenizer import Tokenizer

    try:
        tokenizer = Tokenizer.from_gguf(resolve_model(model))
        ids = tokenizer.encode(text, add_special=not no_bos)
    except SkippyError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(ids))
    else:
        click.echo(" ".join(str(i) for i in ids))


main.add_command(serve)  # the gateway's command; its options live beside it in gateway/cli.py
main.add_command(bench)  # the benchmarks' group; its subcommands live in bench/command.py

if __name__ == "__main__":
    main()
