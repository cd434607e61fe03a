"""The planner: costs in, contiguous balanced ranges out (in-process, no model file needed)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import attrs
import pytest

from skippy_zmq.errors import ConfigError
from skippy_zmq.launch.memory import MemoryModel, StageLimits
from skippy_zmq.launch.planner import (
    MEASURED,
    READ_UNIT,
    CostKey,
    CostModel,
    balanced_ranges,
    plan_model,
    plan_stages,
)
from skippy_zmq.model.gguf_file import GGUFHeader, TensorInfo, read_header
from skippy_zmq.model.gguf_model import ModelHParams, read_hparams, require_gguf
from skippy_zmq.testing.random_model import SHAPES, ModelShape, TensorPlan, plan_tensors

GEMMA3_270M = ModelHParams(
    arch="gemma3", n_layer=18, n_embd=640, n_head=4, n_head_kv=1, head_dim=256, n_ff=2048,
    n_vocab=262144, rms_eps=1e-6, rope_freq_base=1e6, rope_freq_base_local=1e4, rope_neox=True,
    sliding_window=512, n_ctx_train=32768,
)


def _hparams(**changes: object) -> ModelHParams:
    return attrs.evolve(GEMMA3_270M, **changes)


def _brute_force_best(costs: CostModel, n_stages: int) -> float:
    """The smallest busiest-stage cost over every contiguous cut."""
    n = costs.n_layer
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), n_stages - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(costs.stage_cost(a, b) for a, b in itertools.pairwise(bounds)))
    return best


def _check_tiling(ranges: tuple[tuple[int, int], ...] | list[tuple[int, int]], n_layer: int) -> None:
    assert ranges[0][0] == 0 and ranges[-1][1] == n_layer
    assert all(end > start for start, end in ranges)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


@pytest.mark.parametrize("n_layer", [1, 4, 7, 18])
@pytest.mark.parametrize("head", [0.0, 0.5, 3.0, 40.0])
def test_plans_tile_the_layers_and_minimize_the_busiest_stage(n_layer: int, head: float) -> None:
    layer_costs = tuple(1.0 + (il % 3) * 0.25 for il in range(n_layer))
    costs = CostModel(layer_costs=layer_costs, head_cost=head, source="test")
    for n_stages in range(1, min(n_layer, 5) + 1):
        plan = plan_stages(costs, n_stages)
        assert len(plan.ranges) == n_stages
        _check_tiling(plan.ranges, n_layer)
        assert max(plan.stage_costs) == pytest.approx(_brute_force_best(costs, n_stages))
        assert sum(plan.stage_costs) == pytest.approx(sum(layer_costs) + head)


def test_equal_layers_split_evenly() -> None:
    assert balanced_ranges(18, 3) == [(0, 6), (6, 12), (12, 18)]
    assert balanced_ranges(18, 2) == [(0, 9), (9, 18)]
    assert [b - a for a, b in balanced_ranges(7, 3)] in ([2, 2, 3], [2, 3, 2], [3, 2, 2])


def test_the_head_weighs_on_the_final_stage() -> None:
    # A head worth 6 layers: 18 + 6 = 24 units, 8 per stage.
    assert balanced_ranges(18, 3, head_layers=6.0) == [(0, 8), (8, 16), (16, 18)]
    # Heavier than everything else: the final stage keeps one layer, the rest share evenly.
    plan = plan_stages(CostModel.uniform(18, 30.0), 3)
    assert plan.ranges[-1] == (17, 18)
    assert sorted(b - a for a, b in plan.ranges[:2]) == [8, 9]


def test_degenerate_cases() -> None:
    assert balanced_ranges(1, 1) == [(0, 1)]
    assert balanced_ranges(5, 5) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    plan = plan_stages(CostModel(layer_costs=(0.0, 0.0, 0.0), head_cost=0.0, source="zero"), 2)
    _check_tiling(plan.ranges, 3)
    for n_stages in (0, 6):
        with pytest.raises(ConfigError, match="cannot cut 5 layers into"):
            balanced_ranges(5, n_stages)
    with pytest.raises(ConfigError, match="at least one layer"):
        CostModel(layer_costs=(), head_cost=1.0, source="none")
    with pytest.raises(ConfigError, match=">= 0"):
        CostModel(layer_costs=(1.0, -1.0), head_cost=1.0, source="negative")


def test_measured_costs_are_used_for_gemma3_270m() -> None:
    hp = _hparams()
    assert CostKey.of(hp) in MEASURED
    costs = CostModel.for_model(hp, batch=16)
    assert costs.unit == "ms" and costs.source.startswith("measured at batch 16")
    assert CostModel.for_model(hp, batch=6).source.startswith("measured at batch 8")
    # The head is worth many layers, so the final stage keeps a single layer.
    assert costs.head_cost > 10 * max(costs.layer_costs)
    for n_stages in (2, 3):
        plan = plan_model(hp, n_stages)
        _check_tiling(plan.ranges, 18)
        assert plan.ranges[-1] == (17, 18)
    assert "stage 2: layers 17..18 (1 + head)" in plan_model(hp, 3).describe()


def test_unknown_models_fall_back_to_weight_sizes() -> None:
    hp = _hparams(n_layer=12, n_vocab=32000, arch="llama", n_head=8, n_head_kv=8, head_dim=80)
    costs = CostModel.for_model(hp)
    assert costs.unit == "bytes"
    layer = 4 * (640 * 80 * (2 * 8 + 2 * 8) + 3 * 640 * 2048)
    assert costs.layer_costs == (float(layer),) * 12
    assert costs.head_cost == 4.0 * 32000 * 640
    plan = plan_model(hp, 3)
    _check_tiling(plan.ranges, 12)
    assert max(plan.stage_costs) == pytest.approx(_brute_force_best(costs, 3))


def _fitting_brute_force(memory: MemoryModel, limits: StageLimits, batch: int, n_stages: int) -> float:
    """The lightest busiest stage, by the bytes a step of `batch` rows reads, over every cut whose stages fit."""
    n = memory.n_layer

    def reads(start: int, end: int) -> float:
        layers = sum(memory.active_bytes(il, batch) for il in range(start, end))
        return layers + (memory.head_weights if end == n else 0)

    best = float("inf")
    for cuts in itertools.combinations(range(1, n), n_stages - 1):
        ranges = list(itertools.pairwise((0, *cuts, n)))
        if all(memory.stage(a, b).total <= limit for (a, b), limit in zip(ranges, limits.limits, strict=True)):
            best = min(best, max(reads(a, b) for a, b in ranges))
    return best


@pytest.mark.parametrize("batch", [1, 4, 64])
def test_an_expert_file_is_cut_by_the_bytes_a_step_reads_within_every_stages_memory(
        expert_mini_path: Path, batch: int) -> None:
    header, hp = read_header(expert_mini_path), read_hparams(expert_mini_path)
    memory = MemoryModel.of_model(header, hp, quantized=True, ctx_size=64, lanes=batch)
    for n_stages in range(1, hp.n_layer + 1):
        # From the tightest limit some cut meets to one every cut meets: the limits decide, then the time.
        tightest = min(max(memory.stage(a, b).total for a, b in itertools.pairwise((0, *cuts, hp.n_layer)))
                       for cuts in itertools.combinations(range(1, hp.n_layer), n_stages - 1))
        for limit in (tightest - 1, tightest, tightest + 2 * max(memory.layer_weights), 1 << 40):
            limits = StageLimits.uniform(limit, n_stages)
            best = _fitting_brute_force(memory, limits, batch, n_stages)
            if best == float("inf"):
                with pytest.raises(ConfigError, match="fits the memory limits"):
                    plan_model(hp, n_stages, batch, memory=memory, limits=limits, quantized=True)
                continue
            plan = plan_model(hp, n_stages, batch, memory=memory, limits=limits, quantized=True)
            _check_tiling(plan.ranges, hp.n_layer)
            assert plan.stage_memory is not None and all(m.total <= limit for m in plan.stage_memory)
            assert max(plan.stage_costs) == pytest.approx(best)
    costs = CostModel.from_file_bytes(memory, batch)
    assert costs.unit == READ_UNIT
    assert costs.source.startswith(f"the file's bytes a decode step reads per layer at batch {batch}: experts "
                                   f"{hp.n_expert_used} of {hp.n_expert} a row, ")
    assert costs.head_cost == memory.head_weights  # the head is read whole
    # each stage's line gives both: the bytes a step reads, the memory it holds
    lines = plan_model(hp, 2, batch, memory=memory, limits=StageLimits.uniform(1 << 30, 2),
                       quantized=True).describe().splitlines()
    assert len(lines) == 4 and lines[0] == f"# cost model: {costs.source}"
    for line in lines[2:]:
        assert re.fullmatch(r"# stage \d: layers \d\.\.\d \(\d( \+ head)?\): reads [\d.]+ [KM]iB a step \(\d+% of "
                            r"the busiest\); memory [\d.]+ MiB \(weights [\d.]+ [KM]iB, .*\) of 1 GiB", line), line


def _planned_header(plans: list[TensorPlan], source: str) -> GGUFHeader:
    """A header holding only the tensor table `plan_tensors` gives (all the memory model reads of one)."""
    types = require_gguf().GGMLQuantizationType
    tensors = {plan.name: TensorInfo(name=plan.name, dims=tuple(reversed(plan.shape)),
                                     ggml_type=int(types[plan.type_name]), data_offset=0) for plan in plans}
    return GGUFHeader(source=source, version=3, metadata={}, tensors=tensors, alignment=32, data_start=0,
                      file_size=0)


def _shape_hparams(shape: ModelShape, n_vocab: int) -> ModelHParams:
    return ModelHParams(arch=shape.arch, n_layer=shape.n_layer, n_embd=shape.n_embd, n_head=shape.n_head,
                        n_head_kv=shape.n_head_kv, head_dim=shape.head_dim, n_ff=shape.n_ff, n_vocab=n_vocab,
                        rms_eps=shape.rms_eps, rope_freq_base=shape.rope_freq_base,
                        rope_freq_base_local=shape.rope_freq_base, rope_neox=True, sliding_window=0,
                        n_ctx_train=shape.context_length, n_expert=shape.n_expert,
                        n_expert_used=shape.n_expert_used, n_ff_exp=shape.n_ff_exp)


def test_qwen3_30b_a3bs_head_weighs_several_of_its_layers_so_the_final_stage_gets_fewer() -> None:
    shape, n_vocab = SHAPES["qwen3-30b-a3b"], 151936  # the vocabulary as the published file pads it
    hp = _shape_hparams(shape, n_vocab)
    header = _planned_header(plan_tensors(shape, n_vocab), "qwen3-30b-a3b")  # the published file's types
    memory = MemoryModel.of_model(header, hp, quantized=True, ctx_size=2048, lanes=1)
    layer = memory.layer_weights[0]
    assert memory.head_weights < layer  # by what a stage holds the Q6_K head is under one layer
    assert 0.08 < memory.active_bytes(0, 1) / layer < 0.11  # but a token reads about a tenth of a layer
    costs = CostModel.from_file_bytes(memory, batch=1)
    assert costs.head_cost > 6 * max(costs.layer_costs)
    assert "experts 8 of 128 a row, 8.0 of 128 a layer under uniform routing" in costs.source
    limits = StageLimits.uniform(16 << 30, 4)
    held = plan_stages(CostModel.from_file_bytes(attrs.evolve(memory, experts=None)), 4, memory, limits)
    read = plan_model(hp, 4, batch=1, memory=memory, limits=limits, quantized=True)
    assert held.ranges[-1] == (37, 48) and read.ranges[-1] == (42, 48)
    # the total-bytes cut's final stage reads about a third more a step than this cut's busiest
    assert max(read.stage_costs) == pytest.approx(_fitting_brute_force(memory, limits, 1, 4))
    assert costs.stage_cost(37, 48) > 1.25 * max(read.stage_costs)
    # more rows a step read more experts: the head weighs less and the final stage takes layers back
    finals = []
    for batch in (1, 4, 16, 64):
        wide = MemoryModel.of_model(header, hp, quantized=True, ctx_size=2048, lanes=batch)
        plan = plan_model(hp, 4, batch=batch, memory=wide, limits=limits, quantized=True)
        finals.append(plan.ranges[-1][1] - plan.ranges[-1][0])
    assert finals == sorted(finals) and finals[0] == 6 and finals[-1] >= 11


def test_a_dense_file_plans_as_by_its_weight_bytes_at_any_batch(tiny_llama_path: Path) -> None:
    header, hp = read_header(tiny_llama_path), read_hparams(tiny_llama_path)
    memory = MemoryModel.of_model(header, hp, quantized=True, ctx_size=64, lanes=2)
    by_bytes = CostModel(layer_costs=tuple(float(b) for b in memory.layer_weights),
                         head_cost=float(memory.head_weights), source="", unit="bytes")
    for batch in (1, 16):
        costs = CostModel.from_file_bytes(memory, batch)
        assert costs.layer_costs == by_bytes.layer_costs and costs.head_cost == by_bytes.head_cost
        assert costs.unit == "bytes" and costs.source.startswith("the file's weight bytes per layer (head = ")
        for n_stages in (2, 3):
            limits = StageLimits.uniform(1 << 30, n_stages)
            plan = plan_model(hp, n_stages, batch, memory=memory, limits=limits, quantized=True)
            assert plan.ranges == plan_stages(by_bytes, n_stages, memory, limits).ranges
            assert "bytes (" in plan.describe() and "reads" not in plan.describe()
