"""The `skippy-zmq bench` click group and its subcommands (registered on the main group by skippy_zmq/cli.py).

Thin: options parsed, the benchmark's module imported inside the command (so `skippy-zmq --help` loads
none of them, and BLAS threads are pinned before numpy loads), its table printed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

import click
from click.core import ParameterSource

from skippy_zmq import defaults
from skippy_zmq.errors import BenchError, SkippyError

F = TypeVar("F", bound=Callable[..., Any])


def counts(text: str) -> tuple[int, ...]:
    """`1,8,16` -> (1, 8, 16): positive integers, comma-separated; BenchError naming the bad part."""
    parts = [part.strip() for part in text.split(",")]
    if not any(parts):
        raise BenchError(f"{text!r} holds no count; expected positive integers separated by commas, such as 1,8,16")
    for part in parts:
        if not part.isdigit() or int(part) < 1:
            raise BenchError(f"{part!r} in {text!r} is not a positive integer; expected counts such as 1,8,16")
    return tuple(int(part) for part in parts)


def count_list(_ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    """Click callback: comma-separated positive counts (`--clients 1,8,16`); a usage error says what was wrong."""
    try:
        return counts(value)
    except BenchError as exc:
        raise click.BadParameter(str(exc), param=param) from None


def size_list(_ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    """Click callback: comma-separated byte sizes (`--sizes 4KiB,1MiB`); a usage error says what was wrong."""
    from skippy_zmq.config import parse_size

    try:
        return tuple(parse_size(part, where="--sizes") for part in value.split(","))
    except SkippyError as exc:
        raise click.BadParameter(str(exc), param=param) from None


def shapes(text: str, multiple: int = 256) -> tuple[tuple[int, int], ...]:
    """`4096x4096,4096x14336` -> ((4096, 4096), (4096, 14336)); BenchError naming a part that is not KxN with K a
    `multiple` (whole blocks: 256 values for the K-quants, 32 for Q8_0)."""
    out: list[tuple[int, int]] = []
    for part in (p.strip() for p in text.split(",")):
        k, sep, n = part.partition("x")
        if not (sep and k.isdigit() and n.isdigit() and int(k) > 0 and int(n) > 0 and int(k) % multiple == 0):
            raise BenchError(f"{part!r} in {text!r} is not a shape; expected KxN with K a multiple of {multiple}, "
                             "such as 4096x14336")
        out.append((int(k), int(n)))
    return tuple(out)


def shape_list(_ctx: click.Context, param: click.Parameter, value: str) -> tuple[tuple[int, int], ...]:
    """Click callback: comma-separated matrix shapes (`--shapes 4096x4096`); a usage error says what was wrong."""
    try:
        return shapes(value)
    except BenchError as exc:
        raise click.BadParameter(str(exc), param=param) from None


def block_shape_list(_ctx: click.Context, param: click.Parameter, value: str) -> tuple[tuple[int, int], ...]:
    """As shape_list, K a multiple of 32 (the smallest block; the bench checks its type's own)."""
    try:
        return shapes(value, multiple=32)
    except BenchError as exc:
        raise click.BadParameter(str(exc), param=param) from None


class BenchGroup(click.Group):
    """The group: a SkippyError of any subcommand is a line on stderr and exit 1, Ctrl-C exit 130; SIGTERM and
    SIGHUP unwind like Ctrl-C meanwhile, so what a benchmark started is stopped."""

    def invoke(self, ctx: click.Context) -> Any:
        """Run the subcommand with those rules."""
        try:
            with _signals_unwind():
                return super().invoke(ctx)
        except SkippyError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(1)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)


@contextlib.contextmanager
def _signals_unwind() -> Iterator[None]:
    def _raise(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    if not _main_thread():  # only the main thread may set handlers
        yield
        return
    previous = {signum: signal.signal(signum, _raise) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _say(text: str) -> None:
    """Progress on stderr."""
    click.echo(f"[bench] {text}", err=True)


def _blas_threads(value: int, *, override: bool) -> None:
    """Pin BLAS threads before numpy loads (later it would not take effect, so a process that loaded numpy
    already, a test's, is left alone); without `override` a value in the environment stays."""
    if "numpy" in sys.modules:
        return
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if override or name not in os.environ:
            os.environ[name] = str(value)


def _json_out(func: F) -> F:
    return click.option("--json-out", type=click.File("w"), default=None, metavar="FILE",
                        help="Also write one JSON object per measured row to this file (JSON lines), each with the "
                             "machine and the UTC date.")(func)


def _model_path(model: str | None) -> Path:
    from skippy_zmq.model.catalog import GEMMA3_270M_ALIAS, resolve_model

    return resolve_model(model or GEMMA3_270M_ALIAS, progress=_say)


def _print(report: Any, table: str) -> None:
    click.echo(f"{report.heading()}\n\n{table}")


@click.group(cls=BenchGroup)
def bench() -> None:
    """Benchmarks: progress on stderr, a markdown table on stdout, JSON lines with --json-out.

    Every row carries the machine (CPU model, nproc, AVX2/AVX-512/AMX) and the UTC date.
    Figures and what they mean: docs/BENCHMARKS.md.
    """


@bench.command("serve")
@click.option("--url", default=None, help="A running OpenAI-compatible server (http://HOST:PORT) to measure instead "
                                          "of starting `skippy-zmq serve`.")
@click.option("--model", default=None, help="GGUF path for the serve started here and for {model} "
                                            "(default: the packaged Gemma 3 270M).")
@click.option("--serve-args", default="--stages 1 --lanes 16", show_default=True,
              help="Options of the `skippy-zmq serve` started here (--port is chosen).")
@click.option("--llama-server", "llama_server", default=None, metavar="CMD",
              help='A llama-server command line to run side by side, e.g. "llama-server -m {model} -t 2 -np 16 '
                   '-c 8192"; {model} and {port} are substituted, --port {port} appended when it names no port.')
@click.option("--clients", "client_counts", default="1,8,16,32", callback=count_list, metavar="N[,N...]",
              show_default=True, help="Concurrent streaming clients of each run, comma-separated.")
@click.option("--tokens", type=click.IntRange(min=1), default=64, show_default=True, help="Tokens per request.")
@click.option("--requests", type=click.IntRange(min=1), default=1, show_default=True,
              help="Requests per client, one after another.")
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True,
              help="Rounds of every client count; with --llama-server the order of the servers swaps each round.")
@click.option("--prompt", default=None, help="The prompt of every request (default: the 8 prompts of --texts).")
@click.option("--texts", type=click.Choice(["stories", "grounded"]), default="stories", show_default=True,
              help="The prompt set: story openings (free text), or input-grounded prompts whose continuations "
                   "repeat their own text (a list, code with a change, a quoted passage: speculative decoding).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=600.0,
              show_default=True, help="Seconds one request may take.")
@click.option("--ready-timeout", "ready_timeout_s", type=click.FloatRange(min=0, min_open=True),
              default=defaults.READY_TIMEOUT_S, show_default=True,
              help="Seconds a started server may take to answer 200 on /health.")
@click.option("--label", default="", help="A name for this benchmark on every JSON row.")
@click.option("--one-at-a-time", is_flag=True,
              help="Start each server for its runs of a round and stop it before the other starts (a file "
                   "too big for both servers' memory at once); the order still swaps every round.")
@_json_out
@click.pass_context
def serve_command(ctx: click.Context, url: str | None, model: str | None, serve_args: str,
                  llama_server: str | None, client_counts: tuple[int, ...], tokens: int, requests: int, rounds: int,
                  prompt: str | None, texts: str, timeout_s: float, ready_timeout_s: float, label: str,
                  one_at_a_time: bool,
                  json_out: IO[str] | None) -> None:
    """Serving throughput: streaming clients against `serve` (or --url), side by side with --llama-server.

    Each run: every client sends its requests (greedy, ignore_eos, /v1/completions, streaming) one after
    another; aggregate tok/s, TTFT and ITL p50/p99, requests failed. With --llama-server both servers are
    started first and kept running, and each round runs both at every client count back to back (with
    --one-at-a-time, each server alone for its runs of the round); the second table gives serve /
    llama-server per round and the median. Exit 1 when a request failed.
    """
    from skippy_zmq.bench.report import Report
    from skippy_zmq.bench.serve import ServeBench, run_serve_bench

    if url is not None and ctx.get_parameter_source("serve_args") is not ParameterSource.DEFAULT:
        raise click.UsageError("--serve-args applies to the serve this command starts; with --url it runs already")
    options = ServeBench(client_counts=client_counts, tokens=tokens, requests=requests, rounds=rounds, prompt=prompt,
                         texts=texts, timeout_s=timeout_s, url=url.rstrip("/") if url else None, serve_args=serve_args,
                         model=model, llama_server=llama_server, ready_timeout_s=ready_timeout_s, label=label,
                         one_at_a_time=one_at_a_time)
    report = Report("serve", json_out)
    results = run_serve_bench(options, report, _say)
    _print(report, results.table())
    if results.problems():
        raise BenchError("figures that do not count:\n" + "\n".join(results.problems()))


@bench.command("step")
@click.option("--model", default=None, help="GGUF path (default: the packaged Gemma 3 270M).")
@click.option("--layers", type=(click.IntRange(min=0), click.IntRange(min=1)), default=None, metavar="START END",
              help="The stage's layers [START, END) (default: every layer).")
@click.option("--sessions", "session_counts", default="1,4,16", callback=count_list, metavar="N[,N...]",
              show_default=True, help="Sessions of each row, comma-separated.")
@click.option("--prompt", type=click.IntRange(min=1), default=8, show_default=True, help="Prompt tokens per session.")
@click.option("--steps", type=click.IntRange(min=1), default=6, show_default=True,
              help="Decode steps of each row (their median is reported).")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True, help="Threads of the products.")
@click.option("--gap", "gap_s", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Seconds idle before each decode step, as a stage waits while the others compute.")
@click.option("--repack/--no-repack", default=True, show_default=True,
              help="Repack the weights ggml can interleave, as llama.cpp does by default.")
@click.option("--ctx-size", type=click.IntRange(min=2), default=defaults.CTX_SIZE, show_default=True,
              help="Positions per session.")
@_json_out
def step_command(model: str | None, layers: tuple[int, int] | None, session_counts: tuple[int, ...], prompt: int,
                 steps: int, threads: int, gap_s: float, repack: bool, ctx_size: int,
                 json_out: IO[str] | None) -> None:
    """One stage's prefill and decode step in this process, per session count.

    The kernel is the environment's ($SKIPPY_ZMQ_KERNEL, $SKIPPY_ZMQ_HEAD, ...). Per row: the first
    session's prompt (graphs built on the first row), the same prompt again, the other sessions'
    prompts in one pass, and the median decode step of all sessions in one batch, the head apart.
    """
    _blas_threads(threads, override=True)
    from skippy_zmq.bench.report import Report
    from skippy_zmq.bench.step import StepBench, run_step_bench, step_table

    options = StepBench(model=_model_path(model), layers=layers, session_counts=session_counts, prompt=prompt,
                        steps=steps, threads=threads, gap_s=gap_s, repack=repack, ctx_size=ctx_size)
    report = Report("step", json_out)
    _print(report, step_table(run_step_bench(options, report, _say)))


@bench.command("constraints")
@click.option("--model", default=None, help="GGUF path (default: the packaged Gemma 3 270M).")
@click.option("--sessions", type=click.IntRange(min=1), default=16, show_default=True,
              help="Sessions of each decode step.")
@click.option("--steps", type=click.IntRange(min=1), default=16, show_default=True,
              help="Decode steps of each round (their median is reported).")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Rounds, each constrained and not in turn.")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True, help="Threads of the products.")
@_json_out
def constraints_command(model: str | None, sessions: int, steps: int, rounds: int, threads: int,
                        json_out: IO[str] | None) -> None:
    """What constrained decoding costs: the vocabulary's token trie, typical schemas compiled (and
    again from the cache), and a whole-model decode step of every session constrained and of none,
    in turn (docs/BENCHMARKS.md, "Structured outputs")."""
    _blas_threads(threads, override=True)
    from skippy_zmq.bench.constraints import ConstraintBench, constraint_table, run_constraint_bench
    from skippy_zmq.bench.report import Report

    options = ConstraintBench(model=_model_path(model), sessions=sessions, steps=steps, rounds=rounds, threads=threads)
    report = Report("constraints", json_out)
    _print(report, constraint_table(*run_constraint_bench(options, report, _say)))


@bench.command("pipeline")
@click.option("--model", default=None, help="GGUF path (default: the packaged Gemma 3 270M).")
@click.option("--stages", "stage_counts", default="1,2,3", callback=count_list, metavar="N[,N...]", show_default=True,
              help="Stages of each pipeline, comma-separated.")
@click.option("--tokens", type=click.IntRange(min=1), default=32, show_default=True, help="Decode steps per session.")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Rounds; each measures every setup once.")
@click.option("--ready-timeout", "ready_timeout_s", type=click.FloatRange(min=0, min_open=True),
              default=defaults.READY_TIMEOUT_S, show_default=True, help="Seconds a pipeline may take to get ready.")
@_json_out
def pipeline_command(model: str | None, stage_counts: tuple[int, ...], tokens: int, rounds: int,
                     ready_timeout_s: float, json_out: IO[str] | None) -> None:
    """One process against 1-, 2-, 3-stage pipelines on tcp loopback: decode tok/s at 1 and 4 sessions, each
    hop's transfer time and bytes, bare pyzmq between two processes."""
    _blas_threads(1, override=False)  # the single process as one worker: one BLAS thread each (`worker --threads`)
    from skippy_zmq.bench.pipeline import PipelineBench, run_pipeline_bench
    from skippy_zmq.bench.report import Report

    options = PipelineBench(model=_model_path(model), stage_counts=stage_counts, tokens=tokens, rounds=rounds,
                            ready_timeout_s=ready_timeout_s)
    report = Report("pipeline", json_out)
    _print(report, run_pipeline_bench(options, report, _say).table())


@bench.command("codecs")
@click.option("--sizes", default="4KiB,1MiB,16MiB", callback=size_list,
              metavar="SIZE[,SIZE...]", show_default=True,
              help="Sizes of the float32 arrays, comma-separated.")
@click.option("--repeat", type=click.IntRange(min=1), default=7, show_default=True,
              help="Timed repetitions; the best is kept.")
@_json_out
def codecs_command(sizes: tuple[int, ...], repeat: int, json_out: IO[str] | None) -> None:
    """The activation codecs' encode, decode and lossless selection GB/s against numpy.copyto of the same bytes."""
    from skippy_zmq.bench.codecs import codecs_table, run_codecs_bench
    from skippy_zmq.bench.report import Report

    report = Report("codecs", json_out)
    _print(report, codecs_table(run_codecs_bench(sizes, repeat, report, _say)))


@bench.command("products")
@click.option("--type", "type_name", type=click.Choice(["Q4_K", "Q6_K", "Q8_0"]), default="Q4_K", show_default=True,
              help="The ggml type whose product is measured.")
@click.option("--variant", default="auto", show_default=True,
              help="The package's route against ggml's: auto (the best this CPU runs) or a variant by name.")
@click.option("--shapes", "shape_sizes", default="4096x4096,4096x14336,14336x4096", callback=block_shape_list,
              show_default=True, metavar="KxN[,KxN...]",
              help="Matrix shapes, K inputs by N outputs (the default: an 8B model's attention, up and down).")
@click.option("--rows", "row_counts", default="2,3,4,5,6,7,8,16,32,64", callback=count_list, metavar="N[,N...]",
              show_default=True, help="Activation row counts.")
@click.option("--threads", "thread_counts", default="2,1", callback=count_list, metavar="N[,N...]",
              show_default=True, help="ggml threads.")
@click.option("--rounds", type=click.IntRange(min=1), default=7, show_default=True,
              help="Rounds; the routes alternate, the order swapped every round.")
@_json_out
def products_command(type_name: str, variant: str, shape_sizes: tuple[tuple[int, int], ...],
                     row_counts: tuple[int, ...], thread_counts: tuple[int, ...], rounds: int,
                     json_out: IO[str] | None) -> None:
    """The package's Q4_K or Q6_K product against ggml's own, the products alone, weights from memory.

    Both routes' products must be equal bit for bit; a row count the package's product does not take runs
    ggml's on both sides. Run it on a quiet machine: other work only adds time, spread over both routes.
    """
    _blas_threads(1, override=False)
    from skippy_zmq.bench.products import products_table, run_products_bench
    from skippy_zmq.bench.report import Report

    report = Report("products", json_out)
    rows = run_products_bench(type_name, variant, shape_sizes, row_counts, thread_counts, rounds, report, _say)
    _print(report, products_table(rows))


@bench.command("experts")
@click.option("--type", "type_name", type=click.Choice(["Q4_K", "Q6_K"]), default="Q6_K", show_default=True,
              help="The experts' ggml type (Q4_K repacked, as a stage holds them).")
@click.option("--shape", "shape_sizes", default="768x2048", callback=shape_list, show_default=True, metavar="KxN",
              help="One expert's matrix, K inputs by N outputs (the default: Qwen3-30B-A3B's down; 2048x768 its "
                   "gate and up).")
@click.option("--experts", type=click.IntRange(min=1, max=1024), default=128, show_default=True,
              help="Experts in the layer.")
@click.option("--used", type=click.IntRange(min=1, max=1024), default=8, show_default=True,
              help="Experts each row selects.")
@click.option("--rows", "row_counts", default="1,2,4,7,8,16,32,128", callback=count_list, metavar="N[,N...]",
              show_default=True, help="Pass row counts (sessions of a decode step, or a prompt chunk's rows).")
@click.option("--per-slot/--per-row", default=True, show_default=True,
              help="One activation row per (row, slot), as the down matrices take them, or the row's own, as gate "
                   "and up do.")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True, help="ggml threads.")
@click.option("--rounds", type=click.IntRange(min=1), default=7, show_default=True,
              help="Rounds; the ops alternate, the order swapped every round.")
@_json_out
def experts_command(type_name: str, shape_sizes: tuple[tuple[int, int], ...], experts: int, used: int,
                    row_counts: tuple[int, ...], per_slot: bool, threads: int, rounds: int,
                    json_out: IO[str] | None) -> None:
    """The package's grouped expert op against ggml_mul_mat_id, one layer's experts, new ids every computation.

    Where a stage gives the row count to the package's op, both outputs must be equal bit for bit. Run it on
    a quiet machine.
    """
    if len(shape_sizes) != 1:
        raise click.BadParameter(f"{len(shape_sizes)} shapes; expected one KxN", param_hint="--shape")
    _blas_threads(1, override=False)
    from skippy_zmq.bench.experts import experts_table, run_experts_bench
    from skippy_zmq.bench.report import Report

    report = Report("experts", json_out)
    rows = run_experts_bench(type_name, shape_sizes[0], experts, used, row_counts, threads, rounds, report, _say,
                             per_slot=per_slot)
    _print(report, experts_table(rows))


@bench.command("memory")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="The port COMMAND serves on.")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True,
              help="Unmeasured starts of COMMAND first (a warm start, as a user's second).")
@click.option("--ready-timeout", "ready_timeout_s", type=click.FloatRange(min=0, min_open=True),
              default=defaults.READY_TIMEOUT_S, show_default=True,
              help="Seconds COMMAND may take to answer 200 on /health.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=120.0,
              show_default=True, help="Seconds one completion may take.")
@click.option("--stage", is_flag=True, help="Measure one stage in this process instead of a command.")
@click.option("--model", default=None, help="--stage: GGUF path (default: the packaged Gemma 3 270M).")
@click.option("--layers", type=(click.IntRange(min=0), click.IntRange(min=1)), default=None, metavar="START END",
              help="--stage: the layers [START, END) (default: every layer).")
@click.option("--ctx-size", type=click.IntRange(min=2), default=defaults.CTX_SIZE, show_default=True,
              help="--stage: positions per session.")
@click.option("--lanes", type=click.IntRange(min=1), default=1, show_default=True, help="--stage: sessions filled.")
@click.option("--prompt", type=click.IntRange(min=1), default=198, show_default=True,
              help="--stage: prompt tokens per session.")
@_json_out
def memory_command(command: tuple[str, ...], port: int | None, warmup: int, ready_timeout_s: float,
                   timeout_s: float, stage: bool, model: str | None, layers: tuple[int, int] | None, ctx_size: int,
                   lanes: int, prompt: int, json_out: IO[str] | None) -> None:
    """Start time (to /health 200) and process-tree RSS of a serving COMMAND after 4 completions, or with
    --stage one stage's resident memory against the planner's estimate.

    \b
    skippy-zmq bench memory --port 8131 -- skippy-zmq serve --stages 1 --port 8131
    skippy-zmq bench memory --stage --model MODEL.gguf --layers 0 12 --lanes 4
    """
    from skippy_zmq.bench.memory import command_table, measure_command, measure_stage, stage_table
    from skippy_zmq.bench.report import Report

    if stage == bool(command):
        raise click.UsageError("give a serving command after --, or --stage")
    report = Report("memory", json_out)
    if stage:
        result = measure_stage(_model_path(model), layers, ctx_size=ctx_size, lanes=lanes, prompt=prompt,
                               report=report, progress=_say)
        _print(report, stage_table(result))
        return
    if port is None:
        raise click.UsageError("--port: give the port COMMAND serves on")
    measured = measure_command(command, port=port, warmup=warmup, ready_timeout_s=ready_timeout_s,
                               timeout_s=timeout_s, report=report, progress=_say)
    _print(report, command_table(measured))


def _words(_ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    """Click callback: a pass-through command line split into words (`--worker-args "--x 1"`)."""
    import shlex

    try:
        return tuple(shlex.split(value))
    except ValueError as exc:  # an unclosed quote
        raise click.BadParameter(f"{value!r} cannot be split into words: {exc}", param=param) from None


def _link_modes(_ctx: click.Context, param: click.Parameter, value: str) -> tuple[Any, ...]:
    """Click callback: `--links loopback,100mbit,rpc@100mbit`."""
    from skippy_zmq.bench.links import Mode

    try:
        return tuple(Mode.parse(part) for part in value.split(","))
    except BenchError as exc:
        raise click.BadParameter(str(exc), param=param) from None


def _codec_choices(_ctx: click.Context, param: click.Parameter, value: str) -> tuple[Any, ...]:
    """Click callback: `--codecs raw-f32-v1,f16,auto-lossless-v1`."""
    from skippy_zmq.bench.links import CodecChoice

    try:
        return tuple(CodecChoice.parse(part) for part in value.split(","))
    except BenchError as exc:
        raise click.BadParameter(str(exc), param=param) from None


@bench.command("links")
@click.option("--model", default=None, help="GGUF path (default: the packaged Gemma 3 270M).")
@click.option("--stages", type=click.IntRange(min=1, max=250), default=2, show_default=True,
              help="Stages of the pipeline, one per host namespace (and rpc-servers on the rpc modes).")
@click.option("--links", "modes", default="loopback,100mbit", callback=_link_modes, show_default=True,
              metavar="MODE[,MODE...]",
              help="Modes: loopback (local processes on 127.0.0.1), a rate such as 1gbit or 100mbit (a namespace "
                   "per host, every link shaped both ways), rpc@RATE or rpc@loopback (llama.cpp's RPC backend).")
@click.option("--codecs", default="raw-f32-v1", callback=_codec_choices, show_default=True, metavar="CODEC[,CODEC...]",
              help="Activation codecs of the pipeline modes: wire names or f32, f16, bf16, s8, and auto-lossless-v1.")
@click.option("--micro-batches", "micro_batches", default="1", callback=count_list, show_default=True,
              metavar="N[,N...]", help="serve --micro-batches of the pipeline modes.")
@click.option("--clients", "client_counts", default="1,16", callback=count_list, metavar="N[,N...]",
              show_default=True, help="Concurrent streaming clients of each run, comma-separated.")
@click.option("--tokens", type=click.IntRange(min=1), default=64, show_default=True, help="Tokens per request.")
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True,
              help="Rounds of every setup; every second round runs them in reverse order.")
@click.option("--lanes", type=click.IntRange(min=1), default=16, show_default=True,
              help="Sessions each stage holds; llama-server's -np (its -c is --ctx-size times this).")
@click.option("--ctx-size", type=click.IntRange(min=2), default=defaults.CTX_SIZE, show_default=True,
              help="Positions per session.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Threads of each worker, rpc-server and llama-server (default: as a local pipeline's stages: "
                   "the cores over the stages busy at once).")
@click.option("--requests", type=click.IntRange(min=1), default=1, show_default=True,
              help="Requests each client sends, one after another (client c's request r: prompt c + r of --texts).")
@click.option("--host-cpus", default="none", show_default=True, metavar="none|auto|CPUS",
              help="Each host's CPU budget, as if it were a machine of its own: its processes in a cgroup capped at "
                   "CPUS cores' worth of time (auto: this machine's cores over the hosts); none: every host shares "
                   "every core. Threads default to the budget's whole CPUs.")
@click.option("--texts", type=click.Choice(["stories", "grounded"]), default="stories", show_default=True,
              help="The prompt set: story openings (free text), or input-grounded prompts (bench serve --texts).")
@click.option("--worker-args", default="", callback=_words, help="Added to every `skippy-zmq worker` command.")
@click.option("--serve-args", default="", callback=_words, help="Added to the `skippy-zmq serve --topology` command.")
@click.option("--rpc-server", default=None, metavar="PATH", help="llama.cpp's ggml-rpc-server (rpc modes).")
@click.option("--llama-server", "llama_server", default=None, metavar="PATH",
              help="An RPC-enabled llama-server (rpc modes); its directory goes first on LD_LIBRARY_PATH.")
@click.option("--rpc-server-args", default="", callback=_words, help="Added to every ggml-rpc-server command.")
@click.option("--llama-server-args", default="", callback=_words, help="Added to the llama-server command.")
@click.option("--rpc-cache/--no-rpc-cache", default=True, show_default=True,
              help="ggml-rpc-server -c: tensors cached on local disk, so a later load does not send the weights "
                   "over the shaped links again.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=600.0,
              show_default=True, help="Seconds one request may take.")
@click.option("--ready-timeout", "ready_timeout_s", type=click.FloatRange(min=0, min_open=True),
              default=defaults.READY_TIMEOUT_S, show_default=True,
              help="Seconds a setup's processes may take to serve.")
@click.option("--label", default="", help="A name for this benchmark on every JSON row.")
@click.option("--out", type=click.File("w"), default=None, metavar="FILE",
              help="Also write the report (heading and table, markdown) to this file.")
@_json_out
def links_command(model: str | None, stages: int, modes: tuple[Any, ...], codecs: tuple[Any, ...],
                  micro_batches: tuple[int, ...], client_counts: tuple[int, ...], tokens: int, rounds: int,
                  lanes: int, ctx_size: int, threads: int | None, requests: int, host_cpus: str, texts: str,
                  worker_args: tuple[str, ...], serve_args: tuple[str, ...], rpc_server: str | None,
                  llama_server: str | None, rpc_server_args: tuple[str, ...], llama_server_args: tuple[str, ...],
                  rpc_cache: bool, timeout_s: float, ready_timeout_s: float, label: str, out: IO[str] | None,
                  json_out: IO[str] | None) -> None:
    """A pipeline whose stages run in network namespaces joined by shaped links, against loopback and
    llama.cpp's RPC backend on the same links.

    Stage i runs in host namespace i, each host's veth to a bridge shaped both ways by tbf at the mode's
    rate; the gateway runs in host 0 with stage 0; the benchmark's client reaches it over an unshaped
    link. Per setup (mode, codec, micro-batches) the processes start, every client count runs, they
    stop; the namespaces are deleted at the end, whatever happens. Per run: aggregate tok/s, TTFT and ITL
    p50, and each hop's bytes per generated token. Shaped modes need root, `ip` and `tc`.
    """
    from skippy_zmq.bench.cpu_budget import CpuBudget
    from skippy_zmq.bench.links import LinksBench, run_links_bench
    from skippy_zmq.bench.report import Report
    from skippy_zmq.launch.topology import host_cores

    try:
        budget = CpuBudget.parse(host_cpus, hosts=stages, cores=host_cores())
    except BenchError as exc:
        raise click.BadParameter(str(exc), param_hint="--host-cpus") from None
    options = LinksBench(model=_model_path(model), stages=stages, modes=modes, codecs=codecs,
                         micro_batches=micro_batches, client_counts=client_counts, tokens=tokens, rounds=rounds,
                         lanes=lanes, ctx_size=ctx_size, threads=threads, requests=requests, host_cpus=budget,
                         texts=texts, worker_args=worker_args, serve_args=serve_args, rpc_server=rpc_server,
                         llama_server=llama_server, rpc_server_args=rpc_server_args,
                         llama_server_args=llama_server_args, rpc_cache=rpc_cache,
                         ready_timeout_s=ready_timeout_s, timeout_s=timeout_s, label=label)
    report = Report("links", json_out)
    results = run_links_bench(options, report, _say)
    _print(report, results.table())
    if out is not None:
        out.write(f"{report.heading()}\n\n{results.table()}\n")
    if results.problems():
        raise BenchError("figures that do not count:\n" + "\n".join(results.problems()))


@bench.command("web")
@click.option("--url", default=None, help="A running serve (http://HOST:PORT) to measure, with --pid; default: a "
                                          "serve started here with --serve-args.")
@click.option("--pid", type=click.IntRange(min=1), default=None,
              help="The process id of --url's serve: its CPU time is read from /proc/PID/stat.")
@click.option("--model", default=None, help="GGUF path of the serve started here (default: the packaged Gemma 3 "
                                            "270M).")
@click.option("--serve-args", default="--stages 2 --lanes 4", show_default=True,
              help="Options of the `skippy-zmq serve` started here (--port is chosen).")
@click.option("--pages", type=click.IntRange(min=1), default=10, show_default=True,
              help="Open pages, each polling GET /stages.")
@click.option("--interval", "interval_s", type=click.FloatRange(min=0, min_open=True), default=1.0,
              show_default=True, help="Seconds between one page's polls (the page's own: 1).")
@click.option("--seconds", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="Length of each window (the idle baseline, then the polling).")
@click.option("--baseline/--no-baseline", default=True, show_default=True,
              help="Measure the gateway with nobody polling first, and report what polling adds.")
@click.option("--api-key", envvar="SKIPPY_API_KEY", show_envvar=True, default=None,
              help="The serve's API key, when it has one (GET /stages needs it).")
@click.option("--ready-timeout", "ready_timeout_s", type=click.FloatRange(min=0, min_open=True),
              default=defaults.READY_TIMEOUT_S, show_default=True,
              help="Seconds the serve started here may take to answer 200 on /health.")
@click.option("--label", default="", help="A name for this benchmark on every JSON row.")
@_json_out
@click.pass_context
def web_command(ctx: click.Context, url: str | None, pid: int | None, model: str | None, serve_args: str, pages: int,
                interval_s: float, seconds: float, baseline: bool, api_key: str | None, ready_timeout_s: float,
                label: str, json_out: IO[str] | None) -> None:
    """What the web page's polling costs the gateway: --pages pages polling GET /stages every --interval s for
    --seconds, the gateway process's CPU time from /proc before and after, against the same window idle.

    The table gives each window's CPU time in % of one core and /stages' latency; the last line what the
    polling added. Against a running serve give --url and --pid (`pgrep -f "skippy-zmq serve"`). Exit 1
    when a poll failed.
    """
    from skippy_zmq.bench.report import Report
    from skippy_zmq.bench.web import WebBench, problems, run_web_bench

    if url is not None and ctx.get_parameter_source("serve_args") is not ParameterSource.DEFAULT:
        raise click.UsageError("--serve-args applies to the serve this command starts; with --url it runs already")
    if (url is None) != (pid is None):
        raise click.UsageError("--url and --pid go together: the running serve's address and its process id")
    options = WebBench(pages=pages, interval_s=interval_s, seconds=seconds, baseline=baseline, url=url, pid=pid,
                       api_key=api_key, serve_args=serve_args, model=model, ready_timeout_s=ready_timeout_s,
                       label=label)
    report = Report("web", json_out)
    results = run_web_bench(options, report, _say)
    _print(report, results.table())
    if problems(results):
        raise BenchError("figures that do not count:\n" + "\n".join(problems(results)))
