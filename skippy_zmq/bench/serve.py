"""`bench serve`: the serving workload against `skippy-zmq serve` (started here, or any server at `--url`)
and, side by side, against a llama-server command line.

Every server the comparison needs is started first and kept running: this project's hosts drift by a
fifth within an hour, so a server started for its turn minutes after the other compares badly. Then,
for each round and each client count, the baseline and the candidate run the same workload one right
after the other, the order swapped every round (A B, B A, ...). An idle server computes nothing, so
only its memory stays taken while the other runs. Each pair's ratio (candidate over baseline,
aggregate tok/s) is quoted on its own, and their median over rounds summarizes.

Where two servers do not fit in memory together (a file over half the host's memory), `one_at_a_time`
starts each server for its block of a round (every client count back to back) and stops it before
the other starts, the order still swapped every round: the pairs are minutes apart, not seconds.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from skippy_zmq.bench.clients import TEXTS, RunSummary, Workload
from skippy_zmq.bench.clients import run as run_clients
from skippy_zmq.bench.report import Report, cell, markdown_table
from skippy_zmq.bench.servers import Server, ServerCommand, log_directory, started

BASELINE = "llama-server"
"""The name of the baseline in rows and tables."""
CANDIDATE = "serve"
"""The name of the candidate when this command starts it."""


@attrs.frozen
class Turn:
    """One run: a server (by name) at a client count, in a round (from 1)."""

    round: int
    clients: int
    server: str


def turns(rounds: int, client_counts: Sequence[int], servers: Sequence[str], *,
          one_at_a_time: bool = False) -> list[Turn]:
    """Every run in order: per round, per client count, each server once (`one_at_a_time`: per round,
    each server at every client count); the servers' order as given in odd rounds and reversed in even
    ones, so neither always runs first on a drifting host."""
    order = []
    for round_index in range(1, rounds + 1):
        names = list(servers) if round_index % 2 else list(reversed(servers))
        if one_at_a_time:
            order += [Turn(round_index, count, name) for name in names for count in client_counts]
        else:
            order += [Turn(round_index, count, name) for count in client_counts for name in names]
    return order


@attrs.frozen
class Ratio:
    """Candidate over baseline aggregate tok/s at one client count: each round's, and their median."""

    clients: int
    ratios: tuple[float, ...]

    @property
    def median(self) -> float:
        """The median over rounds."""
        return statistics.median(self.ratios)


def ratios(runs: Sequence[tuple[Turn, RunSummary]], candidate: str, baseline: str) -> list[Ratio]:
    """The ratio of every round that ran both servers, by client count in first-run order (a baseline
    that streamed nothing gives none)."""
    speed = {(t.round, t.clients, t.server): s.aggregate_tok_s for t, s in runs}
    counts = list(dict.fromkeys(t.clients for t, _ in runs))
    rounds = sorted({t.round for t, _ in runs})
    found = []
    for count in counts:
        pairs = [(speed.get((r, count, candidate)), speed.get((r, count, baseline))) for r in rounds]
        values = tuple(c / b for c, b in pairs if c is not None and b)
        if values:
            found.append(Ratio(count, values))
    return found


@attrs.frozen
class ServeBench:
    """What `bench serve` was asked for."""

    client_counts: tuple[int, ...]
    tokens: int
    requests: int = 1
    rounds: int = 1
    prompt: str | None = None
    texts: str = "stories"  # the prompt set (clients.TEXTS) when no `prompt` is given
    timeout_s: float = 600.0
    url: str | None = None  # a running candidate; None: start `skippy-zmq serve`
    serve_args: str = "--stages 1 --lanes 16"
    model: str | None = None
    llama_server: str | None = None  # the baseline's command line template
    ready_timeout_s: float = 300.0
    label: str = ""
    one_at_a_time: bool = False  # each server started for its block of a round, stopped after it

    @property
    def candidate(self) -> str:
        """The candidate's name in rows and tables."""
        return CANDIDATE if self.url is None else self.url

    def workload(self, count: int) -> Workload:
        """The workload of one run at `count` clients."""
        prompts = (self.prompt,) if self.prompt is not None else TEXTS[self.texts]
        return Workload(clients=count, tokens=self.tokens, requests=self.requests, prompts=prompts,
                        timeout_s=self.timeout_s)


@attrs.frozen
class ServeResults:
    """Every run with its figures, and the ratios when there was a baseline."""

    options: ServeBench
    runs: tuple[tuple[Turn, RunSummary], ...]
    ratios: tuple[Ratio, ...]

    def problems(self) -> list[str]:
        """Runs whose figures do not count: requests failed, or fewer tokens than asked for."""
        return [f"{t.server} round {t.round} at {t.clients} clients: {problem}"
                for t, s in self.runs if (problem := s.problem()) is not None]

    def table(self) -> str:
        """The runs' table, then the ratios' when there was a baseline."""
        rows = [(str(t.round), str(t.clients), t.server, cell(s.aggregate_tok_s), cell(s.ttft_p50_ms),
                 cell(s.ttft_p99_ms), cell(s.itl_p50_ms), cell(s.itl_p99_ms), str(s.failed)) for t, s in self.runs]
        text = markdown_table(("round", "clients", "server", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                               "ITL p99 ms", "failed"), rows, "rrlrrrrrr")
        if self.ratios:
            header = ("clients", f"{self.options.candidate} / {BASELINE}, per round", "median")
            text += "\n\n" + markdown_table(header, [
                (str(r.clients), ", ".join(f"{v:.3f}" for v in r.ratios), f"{r.median:.3f}") for r in self.ratios
            ], "rlr")
        return text


def run_serve_bench(options: ServeBench, report: Report, progress: Callable[[str], None]) -> ServeResults:
    """Start what the comparison needs, run every turn, stop what was started; one report row per run and
    one per client count with the ratios."""
    commands = {command.name: command for command in _commands(options)}
    names = ([BASELINE] if options.llama_server is not None else []) + [options.candidate]
    order = turns(options.rounds, options.client_counts, names, one_at_a_time=options.one_at_a_time)
    runs: list[tuple[Turn, RunSummary]] = []
    with log_directory() as logs:
        if options.one_at_a_time:  # a block of turns per (round, server), its server started for it
            blocks = [[t for t in order if (t.round, t.server) == key]
                      for key in dict.fromkeys((t.round, t.server) for t in order)]
        else:
            blocks = [order]
        for block in blocks:
            wanted = [commands[name] for name in dict.fromkeys(t.server for t in block) if name in commands]
            with started(wanted, logs, ready_timeout_s=options.ready_timeout_s, progress=progress) as servers:
                runs += _run_turns(options, block, servers, len(runs), len(order), report, progress)
    found = ratios(runs, options.candidate, BASELINE) if options.llama_server is not None else []
    for ratio in found:
        report.add({"row": "ratio", "label": options.label, "clients": ratio.clients,
                    "candidate": options.candidate, "baseline": BASELINE,
                    "ratios": [round(v, 3) for v in ratio.ratios], "median_ratio": round(ratio.median, 3)})
    return ServeResults(options, tuple(runs), tuple(found))


def _run_turns(options: ServeBench, block: Sequence[Turn], servers: Sequence[Server], done: int, total: int,
               report: Report, progress: Callable[[str], None]) -> list[tuple[Turn, RunSummary]]:
    """The workload of each turn of `block` against its server (started, or the candidate at --url)."""
    by_name: dict[str, Server] = {server.command.name: server for server in servers}
    urls = {server.command.name: server.command.url for server in servers} | (
        {options.candidate: options.url} if options.url is not None else {})
    runs = []
    for index, turn in enumerate(block, start=done + 1):
        if turn.server in by_name:
            by_name[turn.server].check_alive()
        progress(f"run {index}/{total}: {turn.server}, round {turn.round}, {turn.clients} clients x "
                 f"{options.requests} requests x {options.tokens} tokens")
        summary = run_clients(urls[turn.server], options.workload(turn.clients))
        runs.append((turn, summary))
        report.add(_run_row(options, turn, summary))
    for server in servers:  # one that died in the last run: its log says why its requests failed
        server.check_alive()
    return runs


def _commands(options: ServeBench) -> list[ServerCommand]:
    """The baseline first, then the candidate (when this command starts it), each on a free port."""
    from skippy_zmq.launch.topology import free_tcp_ports

    ports = free_tcp_ports(2)
    commands = []
    if options.llama_server is not None:
        model = _model_path(options.model) if "{model}" in options.llama_server else ""
        commands.append(ServerCommand.from_template(BASELINE, options.llama_server, model=model, port=ports[0]))
    if options.url is None:
        commands.append(ServerCommand.skippy_serve(options.serve_args, port=ports[1], model=options.model))
    return commands


def _model_path(model: str | None) -> str:
    """The file `{model}` stands for: --model's, else the packaged model's (assembled on first use)."""
    from skippy_zmq.model.catalog import GEMMA3_270M_ALIAS, resolve_model

    return str(resolve_model(model or GEMMA3_270M_ALIAS))


def _run_row(options: ServeBench, turn: Turn, summary: RunSummary) -> dict[str, Any]:
    return {"row": "run", "label": options.label, "server": turn.server, "round": turn.round,
            "clients": turn.clients, "tokens": options.tokens, "requests_per_client": options.requests,
            **summary.as_json()}
