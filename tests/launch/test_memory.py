"""Memory estimates of stages, the limits per stage, and the check that names a stage over its limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from skippy_zmq.config import TopologyConfig, parse_size
from skippy_zmq.errors import ConfigError
from skippy_zmq.launch.memory import (
    GRAPH_BYTES,
    RUNTIME_BYTES,
    ExpertBytes,
    MemoryModel,
    StageLimits,
    StageMemory,
    check_fits,
    format_bytes,
    tensor_bytes,
)
from skippy_zmq.launch.planner import CostModel, plan_stages
from skippy_zmq.launch.topology import check_topology_memory, free_tcp_ports, topology_toml
from skippy_zmq.model.gguf_file import read_header
from skippy_zmq.model.gguf_model import read_hparams
from tests.conftest import TINY_LLAMA_LAYERS


@pytest.mark.parametrize(("text", "value"), [
    ("6GiB", 6 << 30), ("6G", 6 << 30), ("512MiB", 512 << 20), ("512m", 512 << 20), ("1.5GB", 3 << 29),
    ("4096", 4096), (" 2 KiB ", 2048), ("1T", 1 << 40),
])
def test_sizes_read_in_binary_units(text: str, value: int) -> None:
    assert parse_size(text, where="--max-stage-memory") == value


@pytest.mark.parametrize("text", ["", "GiB", "-1G", "0", "six", "1.2.3M", "nan", "inf", "5X"])
def test_a_bad_size_is_refused_naming_the_option(text: str) -> None:
    with pytest.raises(ConfigError, match=r"--max-stage-memory: .* is not a memory size; expected a positive size"):
        parse_size(text, where="--max-stage-memory")


def test_bytes_are_formatted_in_binary_units() -> None:
    assert [format_bytes(n) for n in (512, 2048, 96 << 20, 5 << 29)] == ["512 B", "2 KiB", "96 MiB", "2.5 GiB"]


def test_the_estimate_adds_the_stages_layers_kv_graphs_and_runtime(tiny_llama_path: Path) -> None:
    header, hp = read_header(tiny_llama_path), read_hparams(tiny_llama_path)
    quantized = MemoryModel.of_model(header, hp, quantized=True, ctx_size=64, lanes=2, cache_type_k="f32",
                                     cache_type_v="f32")
    floats = MemoryModel.of_model(header, hp, quantized=False, ctx_size=64, lanes=2, cache_type_k="f16",
                                  cache_type_v="f16")
    layer0 = [info for name, info in header.tensors.items() if name.startswith("blk.0.")]
    assert quantized.layer_weights[0] == sum(tensor_bytes(info) for info in layer0)
    assert floats.layer_weights[0] == sum(4 * info.n_elements for info in layer0)
    assert quantized.layer_weights[0] < floats.layer_weights[0]  # some of the tiny file's matrices are Q8_0
    # K and V of every KV head, per position, lane and layer: f32 4 bytes a value, f16 2.
    assert quantized.kv_per_layer == 2 * hp.n_head_kv * hp.head_dim * 4 * 64 * 2
    assert floats.kv_per_layer == quantized.kv_per_layer // 2
    middle = quantized.stage(1, 2)
    assert middle == StageMemory(weights=quantized.layer_weights[1], kv=quantized.kv_per_layer, graphs=GRAPH_BYTES,
                                 runtime=RUNTIME_BYTES)
    last = quantized.stage(2, TINY_LLAMA_LAYERS)
    head = tensor_bytes(header.tensors["output.weight"]) + tensor_bytes(header.tensors["output_norm.weight"])
    assert last.weights == sum(quantized.layer_weights[2:]) + head
    assert last.graphs == GRAPH_BYTES + 2 * 2 * hp.n_vocab * 4
    assert last.total == last.weights + last.kv + last.graphs + last.runtime
    with pytest.raises(ConfigError, match=r"layers 3\.\.9 are not a range of the model's 4 layers"):
        quantized.stage(3, 9)
    with pytest.raises(ConfigError, match=r"type_k: cache type 'q4' is unknown; expected one of f32, f16"):
        MemoryModel.of_model(header, hp, quantized=True, ctx_size=64, lanes=2, cache_type_k="q4")


def test_the_tied_embedding_is_the_final_stages_head(tiny_gemma3_path: Path) -> None:
    header, hp = read_header(tiny_gemma3_path), read_hparams(tiny_gemma3_path)
    memory = MemoryModel.of_model(header, hp, quantized=True, ctx_size=64, lanes=1)
    assert "output.weight" not in header.tensors
    assert memory.head_weights == (tensor_bytes(header.tensors["token_embd.weight"])
                                   + tensor_bytes(header.tensors["output_norm.weight"]))


def test_a_head_multiplied_by_matmulnbits_counts_its_packed_copy(tiny_gemma3_path: Path) -> None:
    from skippy_zmq.compute import nbits_head

    header, hp = read_header(tiny_gemma3_path), read_hparams(tiny_gemma3_path)
    asked: list[str] = []
    memory = MemoryModel.of_model(header, hp, quantized=True, ctx_size=64, lanes=1,
                                  head_by_nbits=lambda t: asked.append(t) or True)
    assert asked == ["Q8_0"]  # the tied table's type, as the stage's kernel is asked at load
    # codes of 8 bits, three float32 arrays per block of 32 (scales, sums, ...), the library
    expected = hp.n_vocab * hp.n_embd + 3 * 4 * hp.n_vocab * (hp.n_embd // 32) + nbits_head.LIBRARY_BYTES
    assert nbits_head.resident_bytes("Q8_0", hp.n_vocab, hp.n_embd) == expected
    assert memory.head_weights == expected + tensor_bytes(header.tensors["output_norm.weight"])
    floats = MemoryModel.of_model(header, hp, quantized=False, ctx_size=64, lanes=1, head_by_nbits=lambda t: True)
    assert floats.head_weights == 4 * (hp.n_vocab * hp.n_embd + hp.n_embd)  # the float32 kernels keep theirs


def test_an_expert_layer_holds_every_expert_and_a_step_reads_those_its_rows_pick(expert_mini_path: Path) -> None:
    header, hp = read_header(expert_mini_path), read_hparams(expert_mini_path)
    memory = MemoryModel.of_model(header, hp, quantized=True, ctx_size=64, lanes=4)
    assert memory.experts is not None and hp.has_experts
    assert (memory.experts.n_expert, memory.experts.n_expert_used) == (hp.n_expert, hp.n_expert_used)
    share = hp.n_expert_used / hp.n_expert
    for il in range(hp.n_layer):
        layer = {name: info for name, info in header.tensors.items() if name.startswith(f"blk.{il}.")}
        experts = sum(tensor_bytes(info) for name, info in layer.items() if name.endswith("_exps.weight"))
        assert memory.layer_weights[il] == sum(tensor_bytes(info) for info in layer.values())
        assert memory.experts.per_layer[il] == experts
        rest = memory.layer_weights[il] - experts  # attention, norms and the router
        assert rest >= tensor_bytes(layer[f"blk.{il}.ffn_gate_inp.weight"]) + tensor_bytes(
            layer[f"blk.{il}.attn_q.weight"])
        assert memory.active_bytes(il, 1) == pytest.approx(rest + experts * share)
        assert rest < memory.active_bytes(il, 1) < memory.active_bytes(il, 4) < memory.layer_weights[il]
        assert memory.active_bytes(il, 10_000) == pytest.approx(memory.layer_weights[il])
    # what a stage holds is every expert, whatever a step reads
    assert memory.stage(0, 2).weights == sum(memory.layer_weights[:2])
    assert memory.stage(2, hp.n_layer).weights == sum(memory.layer_weights[2:]) + memory.head_weights


def test_a_dense_layer_is_read_whole(tiny_llama_path: Path) -> None:
    memory = MemoryModel.of_model(read_header(tiny_llama_path), read_hparams(tiny_llama_path), quantized=True,
                                  ctx_size=64, lanes=2)
    assert memory.experts is None
    for batch in (1, 16):
        assert [memory.active_bytes(il, batch) for il in range(memory.n_layer)] == list(memory.layer_weights)


@pytest.mark.parametrize(("n_expert", "n_used", "batch", "expected"), [
    (128, 8, 1, 8.0),                              # one row reads its own k
    (128, 8, 2, 128 * (1 - (120 / 128) ** 2)),     # two rows overlap in 0.5 experts on average
    (8, 2, 2, 3.5),                                # Mixtral: 8 * (1 - 0.75^2)
    (8, 8, 3, 8.0),                                # every expert used: all of them, at any batch
    (16, 4, 1000, 16.0),                           # a large batch reads every expert
])
def test_the_experts_a_step_reads_assume_uniform_routing(n_expert: int, n_used: int, batch: int,
                                                         expected: float) -> None:
    experts = ExpertBytes(per_layer=(), n_expert=n_expert, n_expert_used=n_used)
    assert experts.expected_experts(batch) == pytest.approx(expected)
    assert experts.read_fraction(batch) == pytest.approx(expected / n_expert)


def test_bad_expert_figures_are_refused() -> None:
    with pytest.raises(ConfigError, match="0 experts used of 8; expected 1 to n_expert used"):
        ExpertBytes(per_layer=(1,), n_expert=8, n_expert_used=0)
    with pytest.raises(ConfigError, match="9 experts used of 8"):
        ExpertBytes(per_layer=(1,), n_expert=8, n_expert_used=9)
    with pytest.raises(ConfigError, match=r"expert bytes per layer \(1, -1\) must be >= 0"):
        ExpertBytes(per_layer=(1, -1), n_expert=8, n_expert_used=2)
    with pytest.raises(ConfigError, match="batch 0 must be >= 1"):
        ExpertBytes(per_layer=(1,), n_expert=8, n_expert_used=2).expected_experts(0)
    with pytest.raises(ConfigError, match=r"expert bytes per layer \(5, 5\) must be a part of each of the 2 layers' "
                                          r"weights \(4, 8\)"):
        MemoryModel(layer_weights=(4, 8), head_weights=0, kv_per_layer=0, head_graphs=0, settings="test",
                    experts=ExpertBytes(per_layer=(5, 5), n_expert=8, n_expert_used=2))
    with pytest.raises(ConfigError, match="must be a part of each of the 2 layers"):
        MemoryModel(layer_weights=(4, 8), head_weights=0, kv_per_layer=0, head_graphs=0, settings="test",
                    experts=ExpertBytes(per_layer=(1,), n_expert=8, n_expert_used=2))


def _model(layers: tuple[int, ...], head: int, kv: int = 0, cache: str = "f16") -> MemoryModel:
    return MemoryModel(layer_weights=layers, head_weights=head, kv_per_layer=kv, head_graphs=0, settings="test",
                       cache_types=(cache, cache))


def test_a_stage_over_its_limit_is_named_with_its_bytes_and_the_limit() -> None:
    fixed = GRAPH_BYTES + RUNTIME_BYTES
    memory = _model((1 << 30,) * 4, 2 << 30)
    limits = StageLimits(limits=(fixed + (2 << 30), fixed + (3 << 30)), source="the topology")
    assert [m.total for m in check_fits(memory, [(0, 2), (2, 3)], limits)] == [fixed + (2 << 30), fixed + (1 << 30)]
    with pytest.raises(ConfigError, match=r"stage 1 \(layers 2\.\.4\) \+ head needs 4\.22 GiB \(weights 4 GiB, .*"
                                          r"over its limit of 3\.22 GiB \(the topology\); use more stages, fewer "
                                          r"lanes, a shorter context or a larger limit"):
        check_fits(memory, [(0, 2), (2, 4)], limits)
    with pytest.raises(ConfigError, match="a shorter context, an f16 cache or a larger limit"):
        check_fits(_model((1 << 30,) * 4, 2 << 30, cache="f32"), [(0, 2), (2, 4)], limits)
    with pytest.raises(ConfigError, match="2 memory limits for 3 stages"):
        check_fits(memory, [(0, 1), (1, 2), (2, 4)], limits)


def test_the_planner_takes_the_fastest_cut_that_fits() -> None:
    fixed = GRAPH_BYTES + RUNTIME_BYTES
    costs = CostModel(layer_costs=(1.0,) * 6, head_cost=3.0, source="test")
    memory = _model((1 << 30,) * 6, 0, kv=1 << 29)  # a layer holds 1.5 GiB with its KV
    free = plan_stages(costs, 2)
    assert free.ranges == ((0, 4), (4, 6))  # the head weighs 3 layers: the last stage takes 2
    fitting = plan_stages(costs, 2, memory, StageLimits.uniform(fixed + int(4.5 * (1 << 30)), 2))
    assert fitting.ranges == ((0, 3), (3, 6))  # 4 layers (6 GiB) do not fit 4.5 GiB
    assert fitting.stage_memory is not None and fitting.stage_memory[0].total == fixed + int(4.5 * (1 << 30))
    assert "memory 4.72 GiB (weights 3 GiB, KV 1.5 GiB" in fitting.describe()
    with pytest.raises(ConfigError, match=r"no cut of 6 layers into 2 stages fits the memory limits; the fastest "
                                          r"cut's stage 0 \(layers 0\.\.4\) needs 6\.22 GiB .* over its limit of "
                                          r"4\.22 GiB \(--max-stage-memory\)"):
        plan_stages(costs, 2, memory, StageLimits.uniform(fixed + (4 << 30), 2))
    with pytest.raises(ConfigError, match="needs both a memory model and the stages' limits"):
        plan_stages(costs, 2, memory, None)


def test_an_even_share_divides_the_available_memory() -> None:
    share = StageLimits.even_share(4, available=10 << 30)
    assert share.limits == (int(2.5 * (1 << 30)),) * 4
    assert share.source == "the host's available 10 GiB / 4 stages"


def _topology(model: Path, *, max_memory: list[int] | None) -> TopologyConfig:
    text = topology_toml(model=str(model), ranges=[(0, 2), (2, TINY_LLAMA_LAYERS)], topology_id="mem",
                         ports=free_tcp_ports(3), n_layer=TINY_LLAMA_LAYERS, ctx_size=64, max_memory=max_memory)
    return TopologyConfig.from_toml_text(text, source="mem.toml")


def test_a_topologys_stages_are_checked_against_their_own_limits(tiny_llama_path: Path) -> None:
    roomy = _topology(tiny_llama_path, max_memory=[1 << 30, 1 << 30])
    assert [s.max_memory for s in roomy.stages] == [1 << 30, 1 << 30]
    estimates = check_topology_memory(roomy)
    assert len(estimates) == 2 and all(e.total < 1 << 30 for e in estimates)
    tight = _topology(tiny_llama_path, max_memory=[1 << 30, 100 << 20])
    with pytest.raises(ConfigError, match=r'mem\.toml: stage 1 "stage-1" \(layers 2\.\.4\) \+ head needs .* at '
                                          r'ctx 64 x 8 lanes, K f16 / V f16, over its limit of 100 MiB \(max_memory '
                                          r'of stage 1'):
        check_topology_memory(tight)


def test_a_host_checks_only_the_stages_it_runs(tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tight = _topology(tiny_llama_path, max_memory=[1 << 30, 100 << 20])
    (estimate,) = check_topology_memory(tight, tight.stages[:1])  # stage 1, over its limit, runs elsewhere
    assert estimate == check_topology_memory(_topology(tiny_llama_path, max_memory=None), None)[0]
    # without max_memory the stages this host runs share its memory: two of them get half each
    import skippy_zmq.launch.memory as memory_module

    need = estimate.total
    monkeypatch.setattr(memory_module, "available_bytes", lambda: need + (1 << 20))
    shared = _topology(tiny_llama_path, max_memory=None)
    check_topology_memory(shared, shared.stages[:1])  # one stage here: all of it
    with pytest.raises(ConfigError, match=r"over its limit of .* \(the host's available .* / 2 stages\)"):
        check_topology_memory(shared)


def test_per_host_limits_name_each_stages_host() -> None:
    limits = StageLimits.per_host([("10.0.0.1", 1 << 30), ("10.0.0.2", 2 << 30)])
    assert limits.limits == (1 << 30, 2 << 30) and limits.hosts == ("10.0.0.1", "10.0.0.2")
    assert limits.on_host(1) == " on host 10.0.0.2" and StageLimits.uniform(1, 2).on_host(1) == ""
    memory = _model((1 << 30,) * 4, 0)
    with pytest.raises(ConfigError, match=r"stage 1 \(layers 2\.\.4\) \+ head on host 10\.0\.0\.2 needs 2\.22 GiB .* over "
                                          r"its limit of 2 GiB \(--hosts\)"):
        check_fits(memory, [(0, 2), (2, 4)], StageLimits.per_host([("10.0.0.1", 8 << 30), ("10.0.0.2", 2 << 30)]))


@pytest.mark.parametrize(("value", "message"), [
    ('"lots"', r"max_memory: 'lots' is not a memory size"),
    ("0", "max_memory 0 must be a positive number of bytes"),
    ("true", "max_memory must be a byte count or a size string"),
])
def test_a_bad_max_memory_is_refused_by_stage(tiny_llama_path: Path, value: str, message: str) -> None:
    text = topology_toml(model=str(tiny_llama_path), ranges=[(0, TINY_LLAMA_LAYERS)], topology_id="mem",
                         ports=[5000, 5001], n_layer=TINY_LLAMA_LAYERS)
    text = text.replace("ctx_size =", f"max_memory = {value}\nctx_size =")
    with pytest.raises(ConfigError, match=r'mem\.toml: stage "stage-0": ' + message):
        TopologyConfig.from_toml_text(text, source="mem.toml")
    good = TopologyConfig.from_toml_text(text.replace(f"max_memory = {value}", 'max_memory = "2GiB"'),
                                         source="mem.toml")
    assert good.stages[0].max_memory == 2 << 30


def test_the_graph_allowance_is_what_the_ggml_stage_keeps() -> None:
    from skippy_zmq.compute import graphs

    assert GRAPH_BYTES == graphs.GRAPH_BUFFER_BYTES
