"""Random-weights files of real model shapes: the shape table, llama.cpp's type mixes (Q4_K_M, Q8_0,
Q4_0), the metadata and copied tokenizer, values of the planned scale, streaming, and llama.cpp as the
oracle."""

from __future__ import annotations

import ctypes
import itertools
import math
from pathlib import Path

import attrs
import gguf
import numpy as np
import pytest

from skippy_zmq.errors import ModelLoadError
from skippy_zmq.model.gguf_file import GGUFValueType, read_header
from skippy_zmq.model.gguf_model import GGUFModel, ModelHParams, read_hparams
from skippy_zmq.testing import random_model
from skippy_zmq.testing.random_blocks import BlockPool
from skippy_zmq.testing.random_model import (
    MIXES,
    SHAPES,
    ModelShape,
    RopeScaling,
    TensorPlan,
    TokenizerKeys,
    mix_named,
    plan_tensors,
    q4_0_type,
    q4_k_m_type,
    q8_0_type,
    shape_named,
    use_more_bits,
    write_random_model,
)
from skippy_zmq.testing.tiny import tiny_vocab

GEMMA_VOCAB = 262144
PROMPT = [2, 300, 301, 460, 302, 310, 311, 512, 300, 301, 302, 303, 304]  # past gemma3-mini's window of 8


def _types(plans: list[TensorPlan]) -> dict[str, str]:
    return {plan.name: plan.type_name for plan in plans}


def test_the_real_shapes_have_their_models_dimensions() -> None:
    g12, g4, l8 = SHAPES["gemma3-12b"], SHAPES["gemma3-4b"], SHAPES["llama3-8b"]
    assert (g12.arch, g12.n_embd, g12.n_layer, g12.n_head, g12.n_head_kv, g12.head_dim, g12.n_ff,
            g12.sliding_window, g12.rope_freq_base) == ("gemma3", 3840, 48, 16, 8, 256, 15360, 1024, 1e6)
    assert (g4.n_embd, g4.n_layer, g4.n_head, g4.n_head_kv, g4.head_dim, g4.n_ff, g4.sliding_window) == (
        2560, 34, 8, 4, 256, 10240, 1024)
    assert g12.rope_scaling == g4.rope_scaling == RopeScaling("linear", 8.0)
    assert (l8.arch, l8.n_embd, l8.n_layer, l8.n_head, l8.n_head_kv, l8.head_dim, l8.n_ff, l8.rope_freq_base,
            l8.rope_scaling) == ("llama", 4096, 32, 32, 8, 128, 14336, 500000.0, None)
    q7, q8, q14 = SHAPES["qwen2.5-7b"], SHAPES["qwen3-8b"], SHAPES["qwen3-14b"]
    assert [(s.arch, s.n_embd, s.n_layer, s.n_head, s.n_head_kv, s.head_dim, s.n_ff, s.rope_freq_base)
            for s in (q7, q8, q14)] == [("qwen2", 3584, 28, 28, 4, 128, 18944, 1e6),
                                        ("qwen3", 4096, 36, 32, 8, 128, 12288, 1e6),
                                        ("qwen3", 5120, 40, 40, 8, 128, 17408, 1e6)]


def test_a_shape_the_runtime_cannot_run_is_refused_by_field() -> None:
    good = SHAPES["llama3-mini"]
    with pytest.raises(ModelLoadError, match="'bad': n_head 4 must be a multiple of n_head_kv 3"):
        attrs.evolve(good, name="bad", n_head_kv=3)
    with pytest.raises(ModelLoadError, match="'bad': n_ff = 100 must be a multiple of 32"):
        attrs.evolve(good, name="bad", n_ff=100)
    with pytest.raises(ModelLoadError, match="'bad': sliding_window 8 must be > 0 exactly for"):
        attrs.evolve(good, name="bad", sliding_window=8)
    with pytest.raises(ModelLoadError, match=r"'bad': rms_eps = 0\.0 must be a positive finite number"):
        attrs.evolve(good, name="bad", rms_eps=0.0)
    with pytest.raises(ModelLoadError, match="n_layer = 0 must be > 0"):
        attrs.evolve(good, n_layer=0)
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        attrs.evolve(good, arch="gpt2")
    with pytest.raises(ModelLoadError, match="'llama3-mini' is listed twice in SHAPES"):
        random_model._index([good, good])
    with pytest.raises(ModelLoadError, match="unknown model shape 'gemma3-27b'; known: gemma3-12b, gemma3-4b"):
        shape_named("gemma3-27b")


def test_q4_k_m_gives_attn_v_and_ffn_down_six_bits_on_llama_cpps_layers() -> None:
    # 32 layers: the first and last 4, and every third from layer 6 (llama.cpp's rule)
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27,
                                                              28, 29, 30, 31]
    types = _types(plan_tensors(SHAPES["llama3-8b"], GEMMA_VOCAB))
    assert types["token_embd.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"
    assert types["blk.6.attn_v.weight"] == types["blk.6.ffn_down.weight"] == "Q6_K"
    assert types["blk.7.attn_v.weight"] == types["blk.7.ffn_down.weight"] == "Q4_K"
    assert {types[f"blk.6.{n}.weight"] for n in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")} == {"Q4_K"}
    assert types["blk.0.attn_norm.weight"] == types["output_norm.weight"] == "F32"
    gemma = _types(plan_tensors(SHAPES["gemma3-12b"], GEMMA_VOCAB))
    assert "output.weight" not in gemma and gemma["token_embd.weight"] == "Q6_K"  # the tied head
    assert gemma["blk.0.attn_q_norm.weight"] == "F32"


def test_rows_of_no_whole_256_blocks_fall_back_as_llama_cpp_does() -> None:
    assert q4_k_m_type("blk.1.attn_q.weight", 640, 2, 18, True) == "Q5_0"
    assert q4_k_m_type("token_embd.weight", 640, 2, 18, True) == "Q8_0"
    assert q4_k_m_type("blk.0.ffn_down.weight", 2048 + 32, 2, 18, True) == "Q8_0"
    assert q4_k_m_type("blk.1.attn_q.weight", 48, 2, 18, True) == "F16"
    assert q4_k_m_type("blk.1.attn_q.weight", 4096, 1, 18, True) == "F32"


# What `llama-quantize` gives each tensor kind (src/llama-quant.cpp, llama_tensor_get_type_impl,
# no importance matrix): the head (or the tied embedding) Q6_K unless the file type is Q8_0,
# Q4_K_M's six-bit attn_v and ffn_down on the more-bits layers (6, not 7), norms F32.
KINDS = ("token_embd", "output", "blk.6.attn_v", "blk.7.attn_v", "blk.6.ffn_down", "blk.7.ffn_down",
         "blk.6.attn_q", "blk.6.attn_k", "blk.6.attn_output", "blk.6.ffn_gate", "blk.6.ffn_up", "blk.6.attn_norm")
MIX_TABLE = {
    "Q4_K_M": ("Q4_K", "Q6_K", "Q6_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q4_K", "Q4_K", "Q4_K", "Q4_K", "F32"),
    "Q8_0": ("Q8_0",) * 11 + ("F32",),
    "Q4_0": ("Q4_0", "Q6_K") + ("Q4_0",) * 9 + ("F32",),
}


@pytest.mark.parametrize("mix", list(MIXES))
def test_each_mix_gives_each_tensor_kind_llama_quantizes_type(mix: str) -> None:
    types = _types(plan_tensors(SHAPES["llama3-8b"], GEMMA_VOCAB, mix=mix_named(mix)))
    assert {kind: types[f"{kind}.weight"] for kind in KINDS} == dict(zip(KINDS, MIX_TABLE[mix], strict=True))
    assert types["output_norm.weight"] == "F32"
    gemma = _types(plan_tensors(SHAPES["gemma3-12b"], GEMMA_VOCAB, mix=mix_named(mix)))
    assert gemma["token_embd.weight"] == MIX_TABLE[mix][1]  # tied: the head's type
    assert gemma["blk.0.attn_q_norm.weight"] == gemma["blk.0.post_ffw_norm.weight"] == "F32"
    qwen2 = _types(plan_tensors(SHAPES["qwen2.5-7b"], GEMMA_VOCAB, mix=mix_named(mix)))
    assert qwen2["blk.0.attn_q.bias"] == "F32"


def test_the_32_value_mixes_fall_back_as_llama_cpp_does() -> None:
    # The head wants Q6_K: rows of no whole 256-value block make it Q8_0, of no whole 32-value block F16.
    assert q4_0_type("output.weight", 640, 2, 18, False) == "Q8_0"
    assert q4_0_type("token_embd.weight", 640, 2, 18, True) == "Q8_0"
    assert q4_0_type("token_embd.weight", 640, 2, 18, False) == "Q4_0"
    assert q4_0_type("output.weight", 48, 2, 18, False) == q8_0_type("output.weight", 48, 2, 18, False) == "F16"
    assert q4_0_type("blk.1.attn_q.weight", 48, 2, 18, True) == q8_0_type("blk.1.ffn_down.weight", 48, 2, 18, True) == "F16"
    assert q8_0_type("output.weight", 640, 2, 18, False) == "Q8_0"
    assert q4_0_type("blk.1.attn_q.weight", 4096, 1, 18, True) == q8_0_type("x", 4096, 1, 18, True) == "F32"
    with pytest.raises(ModelLoadError, match="unknown type mix 'Q4_K_S'; known: Q4_K_M, Q8_0, Q4_0"):
        mix_named("Q4_K_S")
    assert [mix.file_type for mix in MIXES.values()] == [15, 7, 2]  # llama.h's enum llama_ftype


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3-mini", "gemma3-mini", "qwen2-mini", "qwen3-mini", "odd", "qwen3moe-mini",
                                  "mixtral-mini", "qwen2moe-mini"])
def test_llama_quantize_gives_each_tensor_the_type_of_the_mix(tmp_path: Path, name: str) -> None:
    # llama.cpp's own quantizer on an F32 file of the shape: llama3-mini's 8 layers have more-bits
    # layers (0, 3, 6, 7), gemma3-mini a tied head, qwen2-mini biases, qwen3-mini q/k norms, and
    # "odd" rows of no whole 256-value block (the fallbacks); qwen3moe-mini an F32 router and expert
    # tensors (ffn_down_exps Q6_K on the more-bits layers), mixtral-mini the rules of 8 experts,
    # qwen2moe-mini a shared expert (its 1-D gate F32, its ffn_down_shexp under the more-bits rule).
    low = pytest.importorskip("llama_cpp.llama_cpp")
    odd = attrs.evolve(SHAPES["llama3-mini"], name="odd", n_embd=320, head_dim=80, n_ff=864)
    shape = odd if name == "odd" else SHAPES[name]

    def f32(plans: list[TensorPlan]) -> list[TensorPlan]:
        return [attrs.evolve(plan, type_name="F32") for plan in plans]

    source = write_random_model(tmp_path / "f32.gguf", shape, edit=f32)
    seen: set[str] = set()
    for mix in MIXES.values():
        params = low.llama_model_quantize_default_params()
        params.ftype, params.nthread = mix.file_type, 1
        out = tmp_path / f"{mix.name}.gguf"
        assert low.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) == 0
        model = GGUFModel(out)
        planned = plan_tensors(shape, model.hparams.n_vocab, mix=mix)
        assert {tensor: model.tensor_type_name(tensor) for tensor in model.header.tensors} == _types(planned), mix
        assert model.header.metadata["general.file_type"] == mix.file_type
        seen |= set(_types(planned).values())
    # odd: Q4_K_M's Q4_K falls back to Q5_0 and Q6_K to Q8_0, as Q4_0's Q6_K head does
    expected = {"Q5_0", "Q8_0", "Q4_0", "F32"} if name == "odd" else {"Q4_K", "Q6_K", "Q8_0", "Q4_0", "F32"}
    assert seen == expected | ({"Q5_K"} if shape.n_expert == 8 else set())  # attn_output of 8 experts


def test_the_planned_files_are_the_size_of_the_real_q4_k_m_files() -> None:
    # Gemma 3 12B Q4_K_M is about 7.3 GB; the header adds a few MB of vocab.
    g12 = sum(plan.nbytes for plan in plan_tensors(SHAPES["gemma3-12b"], GEMMA_VOCAB))
    l8 = sum(plan.nbytes for plan in plan_tensors(SHAPES["llama3-8b"], GEMMA_VOCAB))
    assert 7.25e9 < g12 < 7.35e9 and 5.6e9 < l8 < 5.7e9
    # Llama 3 8B's own vocab: its Q8_0 and Q4_0 files are about 8.5 and 4.7 GB, Q4_K_M 4.9 GB.
    sizes = {mix.name: sum(plan.nbytes for plan in plan_tensors(SHAPES["llama3-8b"], 128256, mix=mix))
             for mix in MIXES.values()}
    assert 8.5e9 < sizes["Q8_0"] < 8.55e9 and 4.6e9 < sizes["Q4_0"] < 4.7e9 and 4.9e9 < sizes["Q4_K_M"] < 4.95e9


def test_a_small_shape_reads_back_as_its_hyper_parameters(tmp_path: Path) -> None:
    for name in ("gemma3-mini", "llama3-mini", "qwen2-mini", "qwen3-mini"):
        shape = SHAPES[name]
        path = write_random_model(tmp_path / f"{name}.gguf", shape)
        hp = ModelHParams.from_gguf(path)
        n_vocab = len(tiny_vocab()[0])
        assert (hp.arch, hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ff, hp.n_vocab,
                hp.rope_freq_base, hp.sliding_window, hp.n_ctx_train) == (
            shape.arch, shape.n_layer, shape.n_embd, shape.n_head, shape.n_head_kv, shape.head_dim, shape.n_ff,
            n_vocab, shape.rope_freq_base, shape.sliding_window, shape.context_length)
        meta = read_header(path).metadata
        assert meta["general.name"] == f"{name}-shaped, tiny tokenizer, vocab {n_vocab}, random weights"
        assert meta["general.file_type"] == 15 and meta["general.quantization_version"] == 2
        assert meta[f"{shape.arch}.rope.dimension_count"] == shape.head_dim


def test_rope_scaling_is_the_shapes_unless_given(tmp_path: Path) -> None:
    def scaling(path: Path) -> tuple[object, object]:
        meta = read_header(path).metadata
        return meta.get("gemma3.rope.scaling.type"), meta.get("gemma3.rope.scaling.factor")

    scaled = SHAPES["gemma3-mini-scaled"]
    assert scaling(write_random_model(tmp_path / "a.gguf", scaled)) == ("linear", 8.0)
    assert scaling(write_random_model(tmp_path / "b.gguf", scaled, rope_scaling=None)) == (None, None)
    four = RopeScaling.parse("linear:4")
    assert scaling(write_random_model(tmp_path / "c.gguf", SHAPES["gemma3-mini"], rope_scaling=four)) == ("linear", 4.0)
    assert scaling(write_random_model(tmp_path / "d.gguf", SHAPES["gemma3-mini"])) == (None, None)
    yarn = read_hparams(write_random_model(tmp_path / "e.gguf", SHAPES["qwen3-mini"],
                                           rope_scaling=RopeScaling("yarn", 4.0, 1024)))
    assert (yarn.rope_scaling.kind, yarn.rope_freq_scale, yarn.rope_n_ctx_orig) == ("yarn", 0.25, 1024)


def test_rope_scaling_text_is_parsed_or_refused_naming_the_form() -> None:
    assert RopeScaling.parse("none") is None
    assert RopeScaling.parse("linear:8") == RopeScaling("linear", 8.0)
    assert RopeScaling.parse("longrope:4") == RopeScaling("longrope", 4.0)
    assert RopeScaling.parse("yarn:4") == RopeScaling("yarn", 4.0)
    assert RopeScaling.parse("yarn:4:32768") == RopeScaling("yarn", 4.0, 32768)
    for text in ("dynamic:4", "linear", "8", "linear:4:32768", "yarn:"):
        with pytest.raises(ModelLoadError, match=f"--rope-scaling '{text}': expected 'none', 'linear:FACTOR'"):
            RopeScaling.parse(text)
    with pytest.raises(ModelLoadError, match="context 'x' is not a whole number"):
        RopeScaling.parse("yarn:4:x")
    with pytest.raises(ModelLoadError, match="original context -5 must be >= 0"):
        RopeScaling.parse("yarn:4:-5")
    with pytest.raises(ModelLoadError, match="factor 'x' is not a number"):
        RopeScaling.parse("linear:x")
    with pytest.raises(ModelLoadError, match=r"factor -1\.0 must be a positive finite number"):
        RopeScaling.parse("linear:-1")


def test_the_tokenizer_is_copied_key_by_key_with_its_types(tmp_path: Path, tiny_llama_path: Path) -> None:
    tokenizer = TokenizerKeys.copied_from(tiny_llama_path)
    assert tokenizer.label == "llama" and tokenizer.n_vocab == len(tiny_vocab()[0])
    path = write_random_model(tmp_path / "m.gguf", SHAPES["gemma3-mini"], tokenizer=tokenizer)
    source, copy = read_header(tiny_llama_path), read_header(path)
    keys = [key for key in source.metadata if key.startswith("tokenizer.")]
    assert len(keys) >= 10 and [key for key in copy.metadata if key.startswith("tokenizer.")] == keys
    for key in keys:
        assert copy.value_types[key] == source.value_types[key], key
        assert np.array_equal(np.asarray(copy.metadata[key]), np.asarray(source.metadata[key])), key
    assert copy.value_types["tokenizer.ggml.bos_token_id"] == (GGUFValueType.UINT32, None)
    bare = gguf.GGUFWriter(tmp_path / "bare.gguf", "llama")
    bare.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    bare.write_header_to_file()
    bare.write_kv_data_to_file()
    bare.write_tensors_to_file()
    bare.close()
    with pytest.raises(ModelLoadError, match=r"bare\.gguf: no tokenizer.ggml.tokens to copy"):
        TokenizerKeys.copied_from(tmp_path / "bare.gguf")
    with pytest.raises(ModelLoadError, match="n_vocab 300 without copied keys; expected the tiny vocab's"):
        TokenizerKeys(label="none", n_vocab=300)


@pytest.mark.parametrize("mix", list(MIXES))
def test_every_tensor_has_the_planned_type_and_scale(tmp_path: Path, mix: str) -> None:
    shape = SHAPES["llama3-mini"]
    path = write_random_model(tmp_path / "m.gguf", shape, seed=3, mix=mix_named(mix))
    model = GGUFModel(path)
    assert model.header.metadata["general.file_type"] == MIXES[mix].file_type
    plans = plan_tensors(shape, model.hparams.n_vocab, mix=mix_named(mix))
    assert {plan.type_name for plan in plans} == {"F32", *MIX_TABLE[mix]}
    assert list(model.header.tensors) == [plan.name for plan in plans]
    for plan in plans:
        assert model.tensor_type_name(plan.name) == plan.type_name, plan.name
        values = model.load_f32(plan.name, plan.shape)
        assert np.isfinite(values).all()
        centre = 1.0 if plan.norm else 0.0
        assert abs(float(values.mean()) - centre) < 0.05 * plan.sigma + 4 * plan.sigma / np.sqrt(values.size)
        assert 0.9 * plan.sigma < float(values.std()) < 1.1 * plan.sigma, plan.name


def test_the_seed_fixes_the_bytes_and_a_matrix_is_written_a_group_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shape = SHAPES["gemma3-mini"]
    a = write_random_model(tmp_path / "a.gguf", shape, seed=1).read_bytes()
    assert a == write_random_model(tmp_path / "b.gguf", shape, seed=1).read_bytes()
    assert a != write_random_model(tmp_path / "c.gguf", shape, seed=2).read_bytes()
    drawn: list[int] = []
    draw = BlockPool.draw

    def counted(pool: BlockPool, rng: np.random.Generator, n: int) -> np.ndarray:
        drawn.append(n)
        return draw(pool, rng, n)

    monkeypatch.setattr(BlockPool, "draw", counted)
    monkeypatch.setattr(random_model, "GROUP_BLOCKS", 4)  # 4 rows of one 256-value block, 2 of two
    write_random_model(tmp_path / "d.gguf", shape, seed=1)
    matrices = [plan for plan in plan_tensors(shape, len(tiny_vocab()[0])) if not plan.norm]
    assert max(drawn) == 4 and len(drawn) == sum(-(-plan.shape[0] * plan.shape[1] // 256 // 4) for plan in matrices)
    assert sum(drawn) == sum(math.prod(plan.shape) // 256 for plan in matrices)


def test_a_failed_write_leaves_neither_a_partial_file_nor_a_changed_target(tmp_path: Path) -> None:
    target = tmp_path / "m.gguf"
    target.write_bytes(b"the previous file")

    def impossible(plans: list[TensorPlan]) -> list[TensorPlan]:
        return [attrs.evolve(plans[0], type_name="IQ2_XXS"), *plans[1:]]  # a type the writer cannot make

    with pytest.raises(ModelLoadError, match=r"ggml type IQ2_XXS can be neither composed here .* needs an importance"):
        write_random_model(target, SHAPES["llama3-mini"], edit=impossible)
    assert target.read_bytes() == b"the previous file" and sorted(tmp_path.iterdir()) == [target]
    with pytest.raises(ModelLoadError, match=r"nowhere/m\.gguf: cannot write the model file: "):
        write_random_model(tmp_path / "nowhere" / "m.gguf", SHAPES["llama3-mini"])


def test_bad_writer_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"output_gain 0\.0 must be a positive finite number"):
        write_random_model(tmp_path / "x.gguf", SHAPES["llama3-mini"], output_gain=0.0)
    with pytest.raises(ModelLoadError, match="rope_scaling 'linear': expected a RopeScaling, None or 'shape'"):
        write_random_model(tmp_path / "x.gguf", SHAPES["llama3-mini"], rope_scaling="linear")


def test_a_shape_with_head_dim_apart_from_n_embd_over_n_head_is_planned_by_head_dim() -> None:
    shape: ModelShape = SHAPES["gemma3-mini"]  # n_embd 256, 2 heads of 256
    shapes = {plan.name: plan.shape for plan in plan_tensors(shape, 100)}
    assert shapes["blk.0.attn_q.weight"] == (512, 256) and shapes["blk.0.attn_k.weight"] == (256, 256)
    assert shapes["blk.0.attn_output.weight"] == (256, 512) and shapes["blk.0.attn_q_norm.weight"] == (256,)


def _llama_cpp_greedy(path: Path, n_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens after PROMPT in llama.cpp, and each step's margin (top logit minus the next)."""
    from tests.pipeline_helpers import plain_llama

    llm = plain_llama(path, n_ctx=128, n_threads=1, logits_all=True)
    llm.eval(PROMPT)
    tokens, margins = [], []
    for _ in range(n_tokens):
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        assert np.isfinite(logits).all()
        top = np.sort(logits)[-2:]
        margins.append(float(top[1] - top[0]))
        tokens.append(int(logits.argmax()))
        llm.eval([tokens[-1]])
    return tokens, margins


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3-mini", "gemma3-mini", "gemma3-mini-scaled", "qwen2-mini", "qwen3-mini",
                                  "qwen3moe-mini", "mixtral-mini", "qwen2moe-mini"])
def test_llama_cpp_loads_a_small_shape_and_its_logits_are_finite(tmp_path: Path, name: str) -> None:
    # llama.cpp reads every key and tensor (it refuses a missing or misshapen one), scaling included.
    path = write_random_model(tmp_path / f"{name}.gguf", SHAPES[name])
    tokens, margins = _llama_cpp_greedy(path, 8)
    assert len(tokens) == 8 and all(m >= 0 for m in margins)


@pytest.mark.slow
@pytest.mark.parametrize(("mix", "q6k_route"), [("Q4_K_M", "ggml"), ("Q4_K_M", "auto"), ("Q4_0", "ggml"),
                                               ("Q4_0", "auto"), ("Q8_0", "ggml")])  # Q8_0 has no Q6_K
@pytest.mark.parametrize("name", ["llama3-mini", "gemma3-mini", "qwen2-mini", "qwen3-mini", "mistral-nemo-mini"])
def test_the_ggml_kernel_gives_llama_cpps_greedy_tokens_on_a_small_shape(tmp_path: Path, name: str, mix: str,
                                                                         q6k_route: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Each type mix (the tiny files have only Q8_0): Q4_K and Q6_K blocks, Q4_0 blocks and a Q6_K
    # head, Q8_0 blocks; every tensor of the type its rule gives. With ggml's Q6_K product: the same
    # bits as llama.cpp, so the same tokens whatever the margins; with the package's (compute/q6k.py,
    # where it is built), the same bits for the 1-row decode steps and, for the 13-row prompt, where
    # llama.cpp takes its tiled kernel, sums in another order: the same tokens on these margins.
    # 13 + 16 positions take gemma3-mini's window of 8 into play.
    from skippy_zmq.compute import ggml, q6k
    from skippy_zmq.runtime.kernels import Kernel
    from skippy_zmq.runtime.stage import StageRuntime

    monkeypatch.setenv(q6k.Q6K_ENV, q6k_route)
    monkeypatch.setattr(ggml, "_native", {})

    path = write_random_model(tmp_path / f"{name}.gguf", SHAPES[name], seed=4, mix=mix_named(mix))
    model = GGUFModel(path)
    types = {plan.name: plan.type_name for plan in plan_tensors(SHAPES[name], model.hparams.n_vocab, mix=MIXES[mix])}
    assert {tensor: model.tensor_type_name(tensor) for tensor in model.header.tensors} == types
    expected, _margins = _llama_cpp_greedy(path, 16)
    # An f32 cache, as the llama.cpp side keeps (plain_llama's default): the same numerics on both sides.
    runtime = StageRuntime.load(path, 0, SHAPES[name].n_layer, ctx_size=128, kernel=Kernel("ggml", repack=False, head="ggml"),
                                weight_cache=None, cache_type_k="f32", cache_type_v="f32")
    runtime.open_session(1)
    chunk, pos, tokens = np.array(PROMPT, np.int32), 0, []
    for _ in range(16):
        logits = runtime.logits(runtime.forward(1, pos, chunk)[-1:])[0]
        pos += len(chunk)
        tokens.append(int(logits.argmax()))
        chunk = np.array(tokens[-1:], np.int32)
    assert tokens == expected


@pytest.mark.slow
@pytest.mark.parametrize("mix", ["Q4_K_M", "Q4_0", "Q8_0"])
@pytest.mark.parametrize("name", ["qwen3moe-mini", "mixtral-mini", "qwen2moe-mini"])
def test_an_expert_file_gives_llama_cpps_greedy_tokens_through_one_to_three_stages(tmp_path: Path, name: str,
                                                                                 mix: str) -> None:
    # The expert layer is llama.cpp's build_moe_ffn in ggml's own operations: with the file's blocks
    # as they lie (no repacking, as plain_llama keeps them) the 1-row decode steps take llama.cpp's
    # bits, so the greedy tokens are llama.cpp's on any margin; split in 2 and 3 stages, the same
    # bits. With the CPU backend's repacked Q4_K and Q4_0 experts (the stages' default) the products
    # sum in another order: the same tokens until the first step whose margin is under 0.02 (one
    # of Q4_0's steps is 0.0035 apart). A head of gain 0.5 lets the tokens (and so the experts) vary.
    from skippy_zmq.runtime.kernels import Kernel
    from skippy_zmq.runtime.stage import StageRuntime

    shape = SHAPES[name]
    path = write_random_model(tmp_path / f"{name}.gguf", shape, seed=4, mix=mix_named(mix), output_gain=0.5)
    expected, margins = _llama_cpp_greedy(path, 16)
    assert len(set(expected)) >= 3, expected

    def greedy(cuts: list[int], repack: bool) -> list[int]:
        kernel = Kernel("ggml", repack=repack, head="ggml")
        bounds = [0, *cuts, shape.n_layer]
        stages = [StageRuntime.load(path, a, b, ctx_size=128, kernel=kernel, weight_cache=None,
                                    cache_type_k="f32", cache_type_v="f32") for a, b in itertools.pairwise(bounds)]
        for stage in stages:
            stage.open_session(1)
        chunk, pos, tokens = np.array(PROMPT, np.int32), 0, []
        for _ in range(16):
            x = stages[0].forward(1, pos, chunk)
            for stage in stages[1:]:
                x = stage.forward(1, pos, x)
            logits = stages[-1].logits(x[-1:])[0]
            pos += len(chunk)
            tokens.append(int(logits.argmax()))
            chunk = np.array(tokens[-1:], np.int32)
        return tokens

    for cuts in ([], [3], [2, 4]):
        assert greedy(cuts, repack=False) == expected, (cuts, min(margins))
    close = next((step for step, margin in enumerate(margins) if margin < 0.02), len(margins))
    assert greedy([3], repack=True)[:close] == expected[:close], margins
