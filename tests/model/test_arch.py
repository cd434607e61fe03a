"""The architecture table: one row per architecture, read by hparams, layer loading and tiny models."""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import pytest

from skippy_zmq.errors import ModelLoadError
from skippy_zmq.float32.layers import RopeTable, load_layer
from skippy_zmq.model.arch import ARCHITECTURES, GEMMA3, LLAMA, SUPPORTED_ARCHITECTURES, arch_spec
from skippy_zmq.model.gguf_model import GGUFModel, ModelHParams


def test_supported_architectures_come_from_the_table() -> None:
    assert SUPPORTED_ARCHITECTURES == tuple(ARCHITECTURES) == ("gemma3", "llama", "qwen2", "qwen3", "qwen3moe",
                                                               "qwen2moe")
    assert {name: spec.experts for name, spec in ARCHITECTURES.items()} == {
        "gemma3": "none", "llama": "optional", "qwen2": "none", "qwen3": "none", "qwen3moe": "required",
        "qwen2moe": "required"}
    assert [name for name, spec in ARCHITECTURES.items() if spec.shared_expert] == ["qwen2moe"]
    assert [name for name, spec in ARCHITECTURES.items() if spec.experts != "none" and not spec.norm_expert_weights] \
        == ["qwen2moe"]
    assert all(spec.name == name for name, spec in ARCHITECTURES.items())
    assert (GEMMA3.ffn_glu, LLAMA.ffn_glu) == ("gelu", "silu") and (GEMMA3.scale_q, LLAMA.scale_q) == (True, False)
    assert "<start_of_turn>" in GEMMA3.chat_fallback and "[INST]" in LLAMA.chat_fallback
    with pytest.raises(ModelLoadError, match=r"m\.gguf: unsupported architecture 'gpt2' \(general\.architecture\); supported: gemma3, llama, qwen2, qwen3, qwen3moe, qwen2moe"):
        arch_spec("gpt2", source="m.gguf")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        GEMMA3.rope_neox = False  # type: ignore[misc]  # the assignment is the point: rows are frozen


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "qwen3"])
def test_hparams_and_layers_follow_the_row(request: pytest.FixtureRequest, arch: str) -> None:
    path: Path = request.getfixturevalue(f"tiny_{arch}_path")
    model = GGUFModel(path)
    hp = model.hparams
    spec = hp.spec
    assert spec is ARCHITECTURES[arch] and hp.rope_neox == spec.rope_neox
    assert model.has_tensor("output.weight") == (not spec.tied_output)
    assert (hp.embed_scale is not None) == spec.scale_embeddings
    sliding = [il for il in range(hp.n_layer) if hp.is_sliding_layer(il)]
    if spec.global_layer_period:
        period = spec.global_layer_period
        assert sliding == [il for il in range(hp.n_layer) if il % period != period - 1]
        assert {hp.layer_rope_base(il) for il in sliding} == {spec.local_rope_freq_base}
    else:
        assert sliding == [] and hp.rope_freq_base_local == hp.rope_freq_base
    lw = load_layer(model, 0, RopeTable.build(4, hp.head_dim, hp.layer_rope_base(0)))
    assert (lw.q_norm is not None, lw.k_norm is not None) == (spec.qk_norm, spec.qk_norm)
    assert (lw.post_attn_norm is not None, lw.post_ffw_norm is not None) == (spec.post_norms, spec.post_norms)


def test_a_sliding_window_of_zero_means_every_layer_is_global() -> None:
    hp = ModelHParams(arch="gemma3", n_layer=12, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128,
                      n_vocab=100, rms_eps=1e-6, rope_freq_base=1e6, rope_freq_base_local=1e4,
                      rope_neox=True, sliding_window=0, n_ctx_train=0)
    assert not any(hp.is_sliding_layer(il) for il in range(12))
    assert {hp.layer_rope_base(il) for il in range(12)} == {1e6}


def test_a_scaled_table_rotates_position_p_as_the_plain_table_rotates_p_times_scale() -> None:
    plain = RopeTable.build(64, 16, 10000.0)
    scaled = RopeTable.build(64, 16, 10000.0, freq_scale=0.25)
    np.testing.assert_allclose(scaled.cos[::4][:16], plain.cos[:16], atol=1e-7)
    np.testing.assert_allclose(scaled.sin[::4][:16], plain.sin[:16], atol=1e-7)
    assert not np.allclose(scaled.cos[1:16], plain.cos[1:16])


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "bound"), [("llama_scaled", 0.15), ("gemma3_scaled", 0.15), ("llama_freqs", 0.15),
                                             ("qwen2_yarn", 0.15), ("llama_yarn", 0.25)])
def test_the_float_path_scales_rope_as_llama_cpp_does(request: pytest.FixtureRequest, arch: str,
                                                      bound: float) -> None:
    # The numpy kernel on the files with linear RoPE scaling (factor 8) stays as close to llama.cpp as on
    # the plain files (0.076 / 0.098 measured, against 0.091 / 0.110 unscaled: llama.cpp quantizes the
    # activations of Q8_0 products, the float path does not); ignoring the scaling moves the logits by
    # 2.3 (llama, every layer) and 0.38 (gemma3, its one global layer). Likewise a rope_freqs.weight
    # (0.093 from llama.cpp; ignoring it moves the logits by 0.90), and YaRN: 0.079 on qwen2, 0.178 on
    # the llama whose attention factor 1.25 makes every score 1.56 times larger (0.105 without it), where
    # reading YaRN as linear scaling moves the logits by 2.1 and 3.6.
    from skippy_zmq.runtime.kernels import Kernel
    from skippy_zmq.runtime.stage import StageRuntime
    from tests.pipeline_helpers import plain_llama

    path: Path = request.getfixturevalue(f"tiny_{arch}_path")
    prompt = [2, 300, 301, 460, 302, 310, 311, 512, 300, 301, 302, 303, 304]
    llm = plain_llama(path, n_ctx=128, n_threads=1, logits_all=True)
    llm.eval(prompt)
    reference = np.array(llm.scores[: len(prompt)], dtype=np.float32)
    runtime = StageRuntime.load(path, 0, GGUFModel(path).hparams.n_layer, ctx_size=128, kernel=Kernel("numpy"),
                                weight_cache=None)
    runtime.open_session(1)
    logits = runtime.logits(runtime.forward(1, 0, np.array(prompt, np.int32)))
    assert float(np.abs(logits - reference).max()) < bound
