"""Topology TOML parsing and validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from skippy_zmq.config import DEFAULT_MODEL, TopologyConfig
from skippy_zmq.errors import ConfigError, SkippyError
from skippy_zmq.link import LinkShape
from skippy_zmq.wire.codecs import ActivationCodec, CodecPolicy

REPO = Path(__file__).resolve().parent.parent

VALID = """
topology_id = "t3"
model = "model.gguf"
n_layer = 18
activation_codec = "raw-f32-v1"
codec_policy = "auto-lossless-v1"

[driver]
return_bind = "tcp://127.0.0.1:5700"

[[stages]]
id = "stage-0"
index = 0
layer_start = 0
layer_end = 6
pull_bind = "tcp://127.0.0.1:5701"
lane_count = 8

[[stages]]
id = "stage-1"
index = 1
layer_start = 6
layer_end = 12
pull_bind = "tcp://127.0.0.1:5702"

[[stages]]
id = "stage-2"
index = 2
layer_start = 12
layer_end = 18
pull_bind = "ipc:///tmp/skippy-stage-2"
ctx_size = 4096
cache_type_k = "f32"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "topology.toml"
    path.write_text(text)
    return path


def test_valid_topology_parses_every_field(tmp_path: Path) -> None:
    topo = TopologyConfig.from_toml(write(tmp_path, VALID))
    assert topo.topology_id == "t3"
    assert topo.model == str(tmp_path / "model.gguf")  # relative to the TOML file
    assert topo.activation_codec is ActivationCodec.RAW_F32_V1
    assert topo.codec_policy is CodecPolicy.AUTO_LOSSLESS_V1
    assert topo.driver.return_bind == topo.driver.return_connect == "tcp://127.0.0.1:5700"
    assert [s.stage_id for s in topo.stages] == ["stage-0", "stage-1", "stage-2"]
    assert [(s.layer_start, s.layer_end) for s in topo.stages] == [(0, 6), (6, 12), (12, 18)]
    assert topo.stages[0].lane_count == 8 and topo.stages[1].lane_count == 4
    assert topo.stages[2].ctx_size == 4096
    # llama.cpp's default f16 unless a stage names its cache types
    assert [(s.cache_type_k, s.cache_type_v) for s in topo.stages] == [("f16", "f16"), ("f16", "f16"), ("f32", "f16")]
    assert topo.stages[1].pull_connect == "tcp://127.0.0.1:5702"
    assert topo.upstream(topo.stages[0]) is None
    assert topo.downstream(topo.stages[0]) is topo.stages[1]
    assert topo.is_final(topo.stages[2]) and not topo.is_final(topo.stages[1])
    assert topo.stage("stage-1") is topo.stage(1)
    topo.check_model_layers(18)
    with pytest.raises(ConfigError, match="n_layer 26"):
        topo.check_model_layers(26)


def test_stages_may_be_listed_in_any_order(tmp_path: Path) -> None:
    blocks = VALID.split("[[stages]]")
    text = blocks[0] + "[[stages]]" + blocks[3] + "[[stages]]" + blocks[1] + "[[stages]]" + blocks[2]
    topo = TopologyConfig.from_toml(write(tmp_path, text))
    assert [s.index for s in topo.stages] == [0, 1, 2]


def test_defaults_and_default_model(tmp_path: Path) -> None:
    text = VALID.replace('model = "model.gguf"\n', "").replace('codec_policy = "auto-lossless-v1"\n', "")
    topo = TopologyConfig.from_toml(write(tmp_path, text))
    assert topo.model == DEFAULT_MODEL
    assert topo.codec_policy is CodecPolicy.FIXED


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("layer_end = 12\n", "layer_end = 5\n", 'stage "stage-1": layer_end 5 must be greater than layer_start 6'),
        ("layer_start = 6\n", "layer_start = 7\n", 'stage "stage-1": layer_start 7 leaves a gap; expected 6'),
        ("layer_start = 12\n", "layer_start = 11\n", 'stage "stage-2": layer_start 11 leaves an overlap; expected 12'),
        ("layer_start = 0\n", "layer_start = 1\n", 'stage "stage-0": layer_start 1 leaves a gap; expected 0'),
        ("index = 2\n", "index = 3\n", "stage indexes [0, 1, 3] must be exactly 0..2"),
        ("index = 2\n", "index = 1\n", "stage indexes [0, 1, 1] must be exactly 0..2"),
        ('id = "stage-2"\n', 'id = "stage-1"\n', 'stage "stage-1": id is used by two stages'),
        ('activation_codec = "raw-f32-v1"', 'activation_codec = "f16-rne-v1"',
         "activation codec policy auto-lossless-v1 is incompatible with configured codec f16-rne-v1"),
        ('activation_codec = "raw-f32-v1"', 'activation_codec = "zstd"', "unknown activation codec 'zstd'"),
        ('codec_policy = "auto-lossless-v1"', 'codec_policy = "auto"', "unknown activation codec policy 'auto'"),
        ('pull_bind = "tcp://127.0.0.1:5702"', 'pull_bind = "udp://x:1"', 'stage "stage-1": pull_bind: endpoint'),
        ('pull_bind = "tcp://127.0.0.1:5702"', 'pull_bind = "tcp://127.0.0.1"', "must look like tcp://HOST:PORT"),
        ('pull_bind = "tcp://127.0.0.1:5702"', 'pull_bind = "tcp://127.0.0.1:5701"', 'stage "stage-1": pull_connect \'tcp://127.0.0.1:5701\' is already used by stage "stage-0"'),
        ('pull_bind = "tcp://127.0.0.1:5702"', 'pull_bind = "tcp://*:5702"', 'stage "stage-1": pull_connect is required because pull_bind'),
        ("lane_count = 8\n", "lane_count = 0\n", 'stage "stage-0": lane_count 0 must be at least 1'),
        ("lane_count = 8\n", "lane_count = true\n", 'stage "stage-0": lane_count must be int, got bool'),
        ("ctx_size = 4096\n", 'ctx_size = "big"\n', 'stage "stage-2": ctx_size must be int, got str'),
        ("ctx_size = 4096\n", "ctx_sise = 4096\n", "stage \"stage-2\": unknown field 'ctx_sise'"),
        ('cache_type_k = "f32"\n', 'cache_type_k = "q8_0"\n',
         "stage \"stage-2\": cache_type_k: cache type 'q8_0' is unknown; expected one of f32, f16 (llama.cpp's names)"),
        ('cache_type_k = "f32"\n', 'cache_type_v = "F16"\n', "stage \"stage-2\": cache_type_v: cache type 'F16' is unknown"),
        ('cache_type_k = "f32"\n', "cache_type_v = 1\n", 'stage "stage-2": cache_type_v must be str, got int'),
        ("n_layer = 18\n", "n_layer = 20\n", 'stage "stage-2": layer_end 18 must equal n_layer 20'),
        ('return_bind = "tcp://127.0.0.1:5700"', 'return_bind = "tcp://0.0.0.0:5700"', "return_connect is required"),
        ('topology_id = "t3"\n', "", "missing required field topology_id"),
        ("layer_start = 6\n", "", 'stage "stage-1": missing required field layer_start'),
        ("lane_count = 8\n", 'lane_count = 8\nkernel = "mkl"\n',
         "stage \"stage-0\": kernel 'mkl' is unknown; expected one of ['ggml', 'numpy', 'onnxruntime']"),
        ("lane_count = 8\n", 'lane_count = 8\ncheck_tensors = "yes"\n',
         'stage "stage-0": check_tensors must be bool, got str'),
        ("lane_count = 8\n", 'lane_count = 8\nemulate_link = "delay=10"\n',
         "stage \"stage-0\": emulate_link 'delay=10': delay '10' is not a duration; expected a non-negative number "
         "and one of the units s, ms, us"),
        ("lane_count = 8\n", "lane_count = 8\nemulate_link = 10\n", 'stage "stage-0": emulate_link must be str, got int'),
        ('codec_policy = "auto-lossless-v1"\n', 'codec_policy = "auto-lossless-v1"\nemulate_link = "loss=1%"\n',
         "emulate_link 'loss=1%': unknown field 'loss'; expected one of delay, jitter, rate, stall"),
    ],
)
def test_invalid_topologies_name_file_stage_and_field(
    tmp_path: Path, old: str, new: str, expected: str
) -> None:
    assert old in VALID
    path = write(tmp_path, VALID.replace(old, new, 1))
    with pytest.raises(ConfigError) as info:
        TopologyConfig.from_toml(path)
    text = str(info.value)
    assert text.startswith(str(path)), text
    assert expected in text
    assert isinstance(info.value, SkippyError) and isinstance(info.value, ValueError)


def test_missing_tables_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        TopologyConfig.from_toml(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        TopologyConfig.from_toml(write(tmp_path, "topology_id = "))
    no_stages = VALID.split("[[stages]]", maxsplit=1)[0]
    with pytest.raises(ConfigError, match="at least one stage"):
        TopologyConfig.from_toml(write(tmp_path, no_stages))
    no_driver = VALID.replace('[driver]\nreturn_bind = "tcp://127.0.0.1:5700"\n', "")
    with pytest.raises(ConfigError, match=r"missing \[driver\]"):
        TopologyConfig.from_toml(write(tmp_path, no_driver))


def test_wildcard_binds_may_repeat_across_containers(tmp_path: Path) -> None:
    text = VALID
    for index in range(3):
        port = 5701 + index
        bind = f'pull_bind = "tcp://127.0.0.1:{port}"' if index < 2 else 'pull_bind = "ipc:///tmp/skippy-stage-2"'
        text = text.replace(bind, f'pull_bind = "tcp://*:5555"\npull_connect = "tcp://stage-{index}:5555"')
    topo = TopologyConfig.from_toml(write(tmp_path, text))
    assert [s.pull_connect for s in topo.stages] == [f"tcp://stage-{i}:5555" for i in range(3)]


@pytest.mark.parametrize("path", sorted((REPO / "config").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_example_topologies_are_valid(path: Path) -> None:
    topo = TopologyConfig.from_toml(path)
    assert topo.stages[0].layer_start == 0


def test_a_stage_may_name_its_kernel(tmp_path: Path) -> None:
    path = write(tmp_path, VALID.replace("lane_count = 8\n", 'lane_count = 8\nkernel = "ggml"\n', 1))
    stages = TopologyConfig.from_toml(path).stages
    assert [stage.kernel for stage in stages] == ["ggml", None, None]


def test_a_stage_may_ask_for_its_tensors_to_be_checked(tmp_path: Path) -> None:
    path = write(tmp_path, VALID.replace("lane_count = 8\n", "lane_count = 8\ncheck_tensors = true\n", 1))
    assert [stage.check_tensors for stage in TopologyConfig.from_toml(path).stages] == [True, False, False]


def test_a_stage_config_built_in_code_refuses_an_unknown_cache_type_too() -> None:
    from skippy_zmq.config import StageConfig

    stage = StageConfig("s", 0, 0, 2, "tcp://127.0.0.1:5701", "tcp://127.0.0.1:5701", cache_type_v="f32")
    assert (stage.cache_type_k, stage.cache_type_v) == ("f16", "f32")
    with pytest.raises(ConfigError, match=r"StageConfig.cache_type_k: cache type 'bf16' is unknown; expected one of f32, f16"):
        StageConfig("s", 0, 0, 2, "tcp://127.0.0.1:5701", "tcp://127.0.0.1:5701", cache_type_k="bf16")


HOSTED = """
topology_id = "hosted"
model = "model.gguf"

[driver]
return_bind = "tcp://0.0.0.0:5700"
return_connect = "tcp://gw.lan:5700"
host = "gw.lan"

[[stages]]
id = "stage-0"
index = 0
layer_start = 0
layer_end = 2
pull_bind = "tcp://0.0.0.0:5701"
pull_connect = "tcp://10.0.0.1:5701"
host = "10.0.0.1"

[[stages]]
id = "stage-1"
index = 1
layer_start = 2
layer_end = 4
pull_bind = "tcp://0.0.0.0:5702"
pull_connect = "tcp://10.0.0.2:5702"

[[stages]]
id = "stage-2"
index = 2
layer_start = 4
layer_end = 6
pull_bind = "tcp://0.0.0.0:5703"
pull_connect = "tcp://10.0.0.1:5703"
host = "10.0.0.1"
"""


def test_stages_and_the_driver_name_the_host_they_run_on(tmp_path: Path) -> None:
    topo = TopologyConfig.from_toml(write(tmp_path, HOSTED))
    assert [s.host for s in topo.stages] == ["10.0.0.1", None, "10.0.0.1"]
    # without a host key, a stage runs where its peers reach it: pull_connect's host
    assert [s.runs_on for s in topo.stages] == ["10.0.0.1", "10.0.0.2", "10.0.0.1"]
    assert (topo.driver.host, topo.driver.runs_on) == ("gw.lan", "gw.lan")
    assert topo.hosts() == {"10.0.0.1": ("stage-0", "stage-2"), "10.0.0.2": ("stage-1",)}
    assert [s.stage_id for s in topo.stages_on("10.0.0.1")] == ["stage-0", "stage-2"]
    assert [s.stage_id for s in topo.stages_on("10.0.0.2")] == ["stage-1"]
    with pytest.raises(ConfigError, match=r"topology\.toml: no stage runs on host 'gw\.lan'; the hosts of its "
                                          r"stages are 10\.0\.0\.1 \(stage-0, stage-2\); 10\.0\.0\.2 \(stage-1\)"):
        topo.stages_on("gw.lan")
    local = TopologyConfig.from_toml(write(tmp_path, VALID))  # an ipc stage runs on no named host
    assert [s.runs_on for s in local.stages] == ["127.0.0.1", "127.0.0.1", None]
    assert local.driver.runs_on == "127.0.0.1" and local.hosts() == {"127.0.0.1": ("stage-0", "stage-1")}


@pytest.mark.parametrize(("old", "new", "expected"), [
    ('host = "10.0.0.1"\n', 'host = "10.0.0.9"\n',
     "stage \"stage-0\": host '10.0.0.9' must be the host of pull_connect 'tcp://10.0.0.1:5701', which is '10.0.0.1'"),
    ('host = "gw.lan"\n', 'host = "10.0.0.1"\n',
     "[driver]: host '10.0.0.1' must be the host of return_connect 'tcp://gw.lan:5700', which is 'gw.lan'"),
    ('host = "gw.lan"\n', "host = 7\n", "[driver]: host must be str, got int"),
    ('pull_connect = "tcp://10.0.0.1:5703"\n', 'pull_connect = "ipc:///tmp/s2"\n',
     "stage \"stage-2\": host '10.0.0.1' needs a tcp:// pull_connect; pull_connect is 'ipc:///tmp/s2'"),
])
def test_a_host_key_must_be_where_peers_connect(tmp_path: Path, old: str, new: str, expected: str) -> None:
    assert old in HOSTED
    path = write(tmp_path, HOSTED.replace(old, new, 1))
    with pytest.raises(ConfigError) as info:
        TopologyConfig.from_toml(path)
    assert str(info.value).startswith(str(path)) and expected in str(info.value)


def test_links_are_not_emulated_unless_the_topology_says_so(tmp_path: Path) -> None:
    topo = TopologyConfig.from_toml(write(tmp_path, VALID))
    assert all(stage.link == LinkShape.off() for stage in topo.stages)
    assert topo.emulated_links() == []


def test_the_topology_emulates_every_link_and_a_stage_may_override_it(tmp_path: Path) -> None:
    text = VALID.replace('codec_policy = "auto-lossless-v1"\n',
                         'codec_policy = "auto-lossless-v1"\nemulate_link = "delay=10ms,rate=100mbit"\n')
    text = text.replace("lane_count = 8\n", 'lane_count = 8\nemulate_link = "off"\n')
    text = text.replace("ctx_size = 4096\n", 'ctx_size = 4096\nemulate_link = "delay=40ms,stall=5ms@2s"\n')
    topo = TopologyConfig.from_toml(write(tmp_path, text))
    assert [stage.link for stage in topo.stages] == [
        LinkShape.off(), LinkShape(delay_ms=10, rate_bit_s=100e6), LinkShape(delay_ms=40, stall_ms=5, stall_every_ms=2000)]
    # the final stage's link is its return link: its replies to the driver
    assert topo.emulated_links() == [
        {"stage": "stage-1", "to": "stage-2", "link": "delay=10ms,rate=100mbit"},
        {"stage": "stage-2", "to": "driver", "link": "delay=40ms,stall=5ms@2s"},
    ]
