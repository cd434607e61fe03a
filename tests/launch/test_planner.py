"""The planner: costs in, contiguous balanced ranges out (in-process, no model file needed)."""

from __future__ import annotations

import itertools

import attrs
import pytest

from skippy_zmq.errors import ConfigError
from skippy_zmq.launch.planner import MEASURED, CostKey, CostModel, balanced_ranges, plan_model, plan_stages
from skippy_zmq.model.gguf_model import ModelHParams

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
