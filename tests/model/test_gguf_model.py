"""GGUF loading: hyper-parameters, tensor dequantization, and load errors by name."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np
import pytest

from skippy_zmq.errors import ModelLoadError
from skippy_zmq.model.gguf_file import GGUFKey, read_header
from skippy_zmq.model.gguf_model import GGUFModel, ModelHParams, read_hparams, require_gguf
from skippy_zmq.runtime.stage import StageRuntime
from skippy_zmq.testing.random_model import SHAPES, RopeScaling, TensorPlan, write_random_model
from skippy_zmq.testing.tiny import tiny_vocab, write_tiny_model


def test_llama_hparams(tiny_llama_path: Path) -> None:
    hp = read_hparams(tiny_llama_path)
    assert (hp.arch, hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ff) == (
        "llama", 4, 64, 4, 2, 16, 128)
    assert hp.n_vocab == len(GGUFModel(tiny_llama_path).header.strings(GGUFKey.TOKENS))
    assert hp.rope_freq_base == hp.rope_freq_base_local == 10000.0
    assert not hp.rope_neox and hp.sliding_window == 0
    assert hp.rms_eps == pytest.approx(1e-6)
    assert not any(hp.is_sliding_layer(il) for il in range(hp.n_layer))


def test_gemma3_hparams(tiny_gemma3_path: Path) -> None:
    hp = ModelHParams.from_gguf(tiny_gemma3_path)
    assert hp.arch == "gemma3" and hp.rope_neox and hp.sliding_window == 8
    assert hp.rope_freq_base == 1e6 and hp.rope_freq_base_local == 10000.0
    assert [hp.is_sliding_layer(il) for il in range(7)] == [True] * 5 + [False, True]
    assert hp.layer_rope_base(5) == 1e6 and hp.layer_rope_base(4) == 10000.0


@pytest.mark.slow
def test_gemma3_270m_hparams(gemma3_270m_path: Path) -> None:
    hp = read_hparams(gemma3_270m_path)
    assert (hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ff, hp.n_vocab) == (
        18, 640, 4, 1, 256, 2048, 262144)
    assert hp.sliding_window == 512 and hp.rope_freq_base == 1e6
    assert [il for il in range(18) if not hp.is_sliding_layer(il)] == [5, 11, 17]


def test_embedding_rows_equal_full_dequantization(tiny_gemma3_path: Path) -> None:
    model = GGUFModel(tiny_gemma3_path)
    hp = model.hparams
    assert model.tensor_type_name("token_embd.weight") == "Q8_0"
    table = model.load_f32("token_embd.weight", (hp.n_vocab, hp.n_embd))
    ids = np.array([0, 5, 5, 1039, 300], dtype=np.int64)
    rows = model.rows_f32("token_embd.weight", (hp.n_vocab, hp.n_embd), ids)
    assert rows.dtype == np.float32 and rows.shape == (5, 64)
    assert np.array_equal(rows, table[ids])
    # Q8_0 keeps values near the random originals (std 1/sqrt(64)) but not exactly
    assert 0.05 < float(table.std()) < 0.2


def test_wrong_tensor_shape_is_refused(tiny_llama_path: Path) -> None:
    model = GGUFModel(tiny_llama_path)
    with pytest.raises(ModelLoadError, match=r"'blk.0.attn_q.weight' has shape \(64, 64\), "
                                             r"expected \(32, 64\)"):
        model.load_f32("blk.0.attn_q.weight", (32, 64))


def _write_gguf(path: Path, arch: str, with_layer_tensors: bool,
                metadata: Mapping[str, str | float] | None = None) -> Path:
    """A minimal GGUF: llama-style metadata (plus `metadata`), an F32 embedding and output norm only."""
    w = gguf.GGUFWriter(path, arch)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_float32(key, value)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.add_tensor("output_norm.weight", np.ones(32, np.float32))
    if with_layer_tensors:
        w.add_tensor("blk.0.attn_norm.weight", np.ones(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unknown_architecture_is_refused_by_name(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "mamba.gguf", "mamba", True)
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'mamba' \(general\.architecture\); supported: "
                                             r"gemma3, llama"):
        read_hparams(path)
    with pytest.raises(ModelLoadError, match="unsupported architecture 'mamba'"):
        StageRuntime.load(path, 0, 1)


@pytest.mark.parametrize(("metadata", "scale"), [
    ({}, 1.0),  # no keys: unscaled
    ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 8.0}, 1.0),  # "none" wins over a factor
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 8.0}, 0.125),
    ({"llama.rope.scaling.factor": 4.0}, 0.25),  # no type: linear, as llama.cpp reads it
    ({"llama.rope.scale_linear": 2.0}, 0.5),  # the older key
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 0.0}, 1.0),  # 0: no scaling
    ({"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 4.0}, 0.25),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, 0.25),
])
def test_linear_rope_scaling_is_read_as_llama_cpp_reads_it(tmp_path: Path, metadata: dict[str, str | float],
                                                          scale: float) -> None:
    hp = read_hparams(_write_gguf(tmp_path / "m.gguf", "llama", True, metadata))
    assert (hp.rope_freq_scale, hp.rope_freq_scale_local) == (scale, scale)
    assert hp.layer_rope_scale(0) == scale


def _ulps(a: float, b: float) -> int:
    return abs(int(np.float32(a).view(np.int32)) - int(np.float32(b).view(np.int32)))


def test_yarn_is_read_with_the_arguments_llama_cpp_gives_ggml(tmp_path: Path) -> None:
    yarn = {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0, "llama.context_length": 131072}
    hp = read_hparams(_write_gguf(tmp_path / "a.gguf", "llama", True, {
        **yarn, "llama.rope.scaling.original_context_length": 32768}))
    scaling = hp.rope_scaling
    assert (scaling.kind, scaling.ext_factor, scaling.beta_fast, scaling.beta_slow) == ("yarn", 1.0, 32.0, 1.0)
    assert (scaling.n_ctx_orig, hp.rope_n_ctx_orig, hp.n_ctx_train) == (32768, 32768, 131072)
    # llama.cpp sets the magnitude 1 + 0.1 ln 4 and divides it out again in float32: 1 within an ulp
    assert _ulps(scaling.attn_factor, 1.0) <= 1
    # without the original context, the file's context_length
    assert read_hparams(_write_gguf(tmp_path / "b.gguf", "llama", True, yarn)).rope_n_ctx_orig == 131072
    # a file's attention factor multiplies, for YaRN and for the others
    with_attn = read_hparams(_write_gguf(tmp_path / "c.gguf", "llama", True, {
        **yarn, "llama.rope.scaling.attn_factor": 1.25})).rope_scaling
    assert _ulps(with_attn.attn_factor, 1.25) <= 1
    linear = read_hparams(_write_gguf(tmp_path / "d.gguf", "llama", True, {
        "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0,
        "llama.rope.scaling.attn_factor": 1.25})).rope_scaling
    assert (linear.kind, linear.ext_factor, linear.attn_factor) == ("linear", 0.0, 1.25)


def test_gemma3_scales_only_its_global_layers(tiny_gemma3_scaled_path: Path) -> None:
    hp = read_hparams(tiny_gemma3_scaled_path)
    assert (hp.rope_freq_scale, hp.rope_freq_scale_local) == (0.125, 1.0)
    assert [hp.layer_rope_scale(il) for il in range(hp.n_layer)] == [1.0] * 5 + [0.125] + [1.0]


def test_a_files_sliding_rope_base_is_read(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "g.gguf", "gemma3", True, {"gemma3.rope.freq_base_swa": 20000.0})
    assert read_hparams(path).rope_freq_base_local == 20000.0


@pytest.mark.parametrize(("metadata", "message"), [
    ({"llama.rope.scaling.type": "dynamic", "llama.rope.scaling.factor": 4.0},
     r"m\.gguf: metadata llama\.rope\.scaling\.type = 'dynamic' is not a RoPE scaling this runtime computes; "
     r"supported: none, linear, yarn, longrope"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.attn_factor": 0.0},
     r"metadata llama\.rope\.scaling\.attn_factor = 0\.0 must be a positive finite number"),
    ({"llama.rope.scaling.type": "yarnish"}, r"llama\.rope\.scaling\.type = 'yarnish'"),
    ({"llama.rope.scaling.factor": -2.0}, r"metadata llama\.rope\.scaling\.factor = -2\.0 must be a finite number >= 0"),
])
def test_rope_scaling_this_runtime_cannot_compute_is_refused_by_key(tmp_path: Path, metadata: dict[str, str | float],
                                                                   message: str) -> None:
    path = _write_gguf(tmp_path / "m.gguf", "llama", True, metadata)
    with pytest.raises(ModelLoadError, match=message):
        read_hparams(path)
    with pytest.raises(ModelLoadError, match=message):
        StageRuntime.load(path, 0, 1)


def test_missing_tensor_is_refused_by_name(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "partial.gguf", "llama", True)
    assert read_hparams(path).n_vocab == 8
    with pytest.raises(ModelLoadError, match=r"tensor 'blk\.0\.attn_q\.weight' is missing"):
        StageRuntime.load(path, 0, 1)


def test_missing_metadata_and_files(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="model file does not exist"):
        read_hparams(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        read_hparams(bad)
    w = gguf.GGUFWriter(tmp_path / "nometa.gguf", "llama")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"metadata key 'llama\.embedding_length' is missing"):
        read_hparams(tmp_path / "nometa.gguf")


def test_missing_gguf_package_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ModelLoadError, match=r"the gguf package is required to load models; "
                                             r"install skippy-zmq\[model\]"):
        require_gguf()


def test_hparams_validation() -> None:
    base = {"arch": "llama", "n_layer": 2, "n_embd": 64, "n_head": 4, "n_head_kv": 2, "head_dim": 16,
            "n_ff": 128, "n_vocab": 100, "rms_eps": 1e-6, "rope_freq_base": 1e4,
            "rope_freq_base_local": 1e4, "rope_neox": False, "sliding_window": 0, "n_ctx_train": 0}
    ModelHParams(**base)  # type: ignore[arg-type]
    with pytest.raises(ModelLoadError, match="n_head 4 must be a multiple of n_head_kv 3"):
        ModelHParams(**{**base, "n_head_kv": 3})  # type: ignore[arg-type]
    with pytest.raises(ModelLoadError, match="n_layer = 0 must be > 0"):
        ModelHParams(**{**base, "n_layer": 0})  # type: ignore[arg-type]
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        ModelHParams(**{**base, "arch": "gpt2"})  # type: ignore[arg-type]


def test_hparams_follow_a_rewritten_file(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "m.gguf", n_layer=2)
    assert read_hparams(path).n_layer == 2
    assert read_hparams(path) is read_hparams(str(path))  # parsed once per file version
    write_tiny_model(path, n_layer=3)
    assert read_hparams(path).n_layer == 3


def _stock_value(field: Any) -> object:
    """A gguf.GGUFReader field's value with the strings of a string array as bytes."""
    value = field.contents()
    if field.types[0] == gguf.GGUFValueType.ARRAY and field.types[-1] == gguf.GGUFValueType.STRING:
        return tuple(s.encode() for s in value)
    return value


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_header_reads_what_the_stock_reader_reads(request: pytest.FixtureRequest, arch: str) -> None:
    path = request.getfixturevalue(f"tiny_{arch}_path")
    header, stock = read_header(path), gguf.GGUFReader(path)
    stock_fields = {k: f for k, f in stock.fields.items() if not k.startswith("GGUF.")}
    assert list(header.metadata) == list(stock_fields)
    for key, field in stock_fields.items():
        value = header.metadata[key]
        got = value.tolist() if isinstance(value, np.ndarray) else value
        assert got == _stock_value(field), key
    assert (header.data_start, header.alignment) == (stock.data_offset, stock.alignment)
    assert [(t.name, t.dims, t.ggml_type, t.data_offset) for t in header.tensors.values()] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), t.data_offset) for t in stock.tensors]
    model = GGUFModel(path)
    for t in stock.tensors:
        data, qtype = model._tensor(t.name, tuple(int(d) for d in reversed(t.shape.tolist())))
        assert qtype == t.tensor_type and data.shape == t.data.shape and data.dtype == t.data.dtype, t.name
        assert data.tobytes() == t.data.tobytes(), t.name


def _cut_inside(path: Path, tensor: str, into: int, out: Path) -> Path:
    """A copy of `path` cut `into` bytes into the data of `tensor` (a download that stopped there)."""
    info = read_header(path).tensors[tensor]
    out.write_bytes(path.read_bytes()[: info.data_offset + into])
    return out


@pytest.mark.parametrize("name", ["llama3-mini", "gemma3-mini"])
def test_a_file_cut_in_the_middle_of_a_layer_is_refused_when_opened(tmp_path: Path, name: str) -> None:
    whole = write_random_model(tmp_path / "whole.gguf", SHAPES[name])
    cut = _cut_inside(whole, "blk.3.ffn_gate.weight", 100, tmp_path / "cut.gguf")
    # Every stage refuses it, those whose layers the cut spares too, naming the tensor it cut.
    with pytest.raises(ModelLoadError, match=r"cut\.gguf: tensor 'blk\.3\.ffn_gate\.weight' ends at byte \d+, past "
                                             r"the end of the \d+-byte file \(\d+ tensor\(s\) run past it\); the "
                                             r"file is truncated"):
        GGUFModel(cut)


def test_a_token_list_longer_than_the_embedding_is_refused_naming_both(tmp_path: Path) -> None:
    def fewer_rows(plans: list[TensorPlan]) -> list[TensorPlan]:
        return [attrs.evolve(p, shape=(p.shape[0] - 40, p.shape[1])) if p.name in ("token_embd.weight", "output.weight")
                else p for p in plans]

    path = write_random_model(tmp_path / "m.gguf", SHAPES["llama3-mini"], edit=fewer_rows)
    assert read_hparams(path).n_vocab == len(tiny_vocab()[0]) - 40  # the hyper-parameters alone still read
    with pytest.raises(ModelLoadError, match=rf"tensor 'token_embd\.weight' has {len(tiny_vocab()[0]) - 40} rows "
                                             rf"but metadata key 'tokenizer\.ggml\.tokens' lists "
                                             rf"{len(tiny_vocab()[0])} tokens; expected one row per token"):
        GGUFModel(path)


@pytest.mark.parametrize("factor", [8.0, 1.0])
def test_an_unknown_rope_scaling_type_is_refused_naming_the_key(tmp_path: Path, factor: float) -> None:
    path = write_random_model(tmp_path / "m.gguf", SHAPES["llama3-mini"], rope_scaling=RopeScaling("yarnish", factor))
    with pytest.raises(ModelLoadError, match=r"llama\.rope\.scaling\.type.*'yarnish'"):
        read_hparams(path)
