"""compute.graphs: a stage's blocks as ggml graphs, against the float32 numpy path and llama.cpp."""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import numpy.typing as npt
import pytest

from skippy_zmq.compute import ggml, graphs
from skippy_zmq.compute.engine import GgmlEngine
from skippy_zmq.model.gguf_model import GGUFModel
from skippy_zmq.runtime.kernels import Kernel
from skippy_zmq.runtime.stage import StageRuntime
from skippy_zmq.testing.tiny import write_tiny_model

pytestmark = pytest.mark.skipif(ggml.unavailable() is not None, reason=f"ggml kernel unavailable: {ggml.unavailable()}")

F32 = npt.NDArray[np.float32]
# 13 tokens: longer than the tiny Gemma 3 sliding window (8), so the window masks keys.
PROMPT = np.array([2, 300, 301, 460, 302, 310, 311, 512, 300, 301, 302, 303, 304], dtype=np.int32)
LAYERS = {"llama": 4, "gemma3": 7, "qwen2": 4, "qwen3": 4}  # gemma3: 7, so one global layer among sliding ones
# How far decode steps may part from one prefill, of the largest logit. The qwen files part most:
# 2.2e-4 (qwen2) and 1.7e-4 (qwen3) measured, where llama.cpp parts as much, since its prefill and
# its decode steps each equal ours bit for bit (tests/compute/test_ggml.py).
STEP_BOUND = {"llama": 1e-4, "gemma3": 1e-4, "qwen2": 5e-4, "qwen3": 5e-4}



def _graphs(runtime: StageRuntime) -> graphs.BlockGraphs:
    """The ggml engine's block graphs of a runtime (every runtime here runs the ggml kernel)."""
    assert isinstance(runtime.engine, GgmlEngine)
    return runtime.engine.graphs

@pytest.fixture(scope="module", params=["llama", "gemma3", "qwen2", "qwen3"])
def float_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with every tensor F32: ggml's products then quantize nothing."""
    arch = str(request.param)
    return write_tiny_model(tmp_path_factory.mktemp(arch) / f"{arch}-f32.gguf", arch=arch, n_layer=LAYERS[arch],
                            quantize=False)


def _logits(path: Path, kernel: str, prompt: npt.NDArray[np.int32] = PROMPT) -> F32:
    runtime = StageRuntime.load(path, 0, GGUFModel(path).hparams.n_layer, ctx_size=64, kernel=Kernel(kernel),
                                weight_cache=None)
    runtime.open_session(1)
    return runtime.logits(runtime.forward(1, 0, prompt))


def test_the_graphs_compute_the_float32_paths_numbers_on_float_weights(float_model: Path) -> None:
    # F32 weights: no activation is quantized, so the graphs and the numpy steps differ only in
    # ggml's own float32 rounding (its GELU table, RoPE angles in float32, the order of sums).
    graphs, numpy = _logits(float_model, "ggml"), _logits(float_model, "numpy")
    assert np.array_equal(graphs.argmax(axis=1), numpy.argmax(axis=1))
    assert float(np.abs(graphs - numpy).max()) < 2e-3 * float(np.abs(numpy).max())
    assert float(np.abs(graphs - numpy).max()) > 0  # ggml's arithmetic, not a call into the numpy path


def test_prefill_then_decode_steps_and_batches_agree_with_one_prefill(float_model: Path) -> None:
    n_layer = GGUFModel(float_model).hparams.n_layer
    whole = _logits(float_model, "ggml")
    runtime = StageRuntime.load(float_model, 0, n_layer, ctx_size=64, kernel=Kernel("ggml"), weight_cache=None)
    for session in (1, 2):
        runtime.open_session(session)
        runtime.forward(session, 0, PROMPT[:5])
    steps = []
    for pos in range(5, len(PROMPT)):
        token = PROMPT[pos:pos + 1]
        both = runtime.forward_batch([1, 2], [pos, pos], np.concatenate([token, token]))
        assert np.array_equal(both[0], both[1])  # two sessions with the same history, one batch
        steps.append(runtime.logits(both[:1])[0])
    assert np.allclose(np.array(steps), whole[5:], atol=STEP_BOUND[GGUFModel(float_model).hparams.arch]
                       * float(np.abs(whole).max()))


def test_layouts_beyond_the_kept_graphs_still_compute_the_same(float_model: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(graphs, "GRAPH_LAYOUTS", 2)
    n_layer = GGUFModel(float_model).hparams.n_layer
    runtime = StageRuntime.load(float_model, 0, n_layer, ctx_size=64, kernel=Kernel("ggml"), weight_cache=None)
    outputs = []
    for session, rows in enumerate((3, 4, 5, 3), start=1):  # a layout per session: the first two are dropped
        runtime.open_session(session)
        outputs.append(runtime.forward(session, 0, PROMPT[:rows]))
    assert [layout.rows for layout in _graphs(runtime)._graphs] == [5, 3]
    assert np.array_equal(outputs[0], outputs[3])
    saved = outputs[3].copy()
    outputs[3][:] = np.nan  # the caller's copy: the graphs' own arrays are not handed out
    runtime.open_session(5)
    assert np.array_equal(runtime.forward(5, 0, PROMPT[:3]), saved)


def test_the_kept_layouts_fit_their_byte_budget_and_the_newest_always_stays(float_model: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    n_layer = GGUFModel(float_model).hparams.n_layer
    runtime = StageRuntime.load(float_model, 0, n_layer, ctx_size=64, kernel=Kernel("ggml"), weight_cache=None)
    for session, rows in enumerate((3, 4), start=1):
        runtime.open_session(session)
        runtime.forward(session, 0, PROMPT[:rows])
    kept = list(_graphs(runtime)._graphs.values())
    assert len(kept) == 2 and all(g.nbytes > 0 for g in kept)
    monkeypatch.setattr(graphs, "GRAPH_BUFFER_BYTES", kept[1].nbytes + 1)  # room for one of them
    runtime.open_session(3)
    runtime.forward(3, 0, PROMPT[:5])
    assert [layout.rows for layout in _graphs(runtime)._graphs] == [5]
    monkeypatch.setattr(graphs, "GRAPH_BUFFER_BYTES", 1)  # room for none: the newest still computes
    runtime.open_session(4)
    out = runtime.forward(4, 0, PROMPT[:6])
    assert [layout.rows for layout in _graphs(runtime)._graphs] == [6] and np.isfinite(out).all()


def test_decode_steps_reuse_their_layouts_graphs(float_model: Path) -> None:
    n_layer = GGUFModel(float_model).hparams.n_layer
    runtime = StageRuntime.load(float_model, 0, n_layer, ctx_size=64, kernel=Kernel("ggml"), weight_cache=None)
    runtime.open_session(1)
    runtime.forward(1, 0, PROMPT[:4])
    for pos in range(4, 10):
        runtime.forward(1, pos, PROMPT[pos:pos + 1])
    assert len(_graphs(runtime)._graphs) == 2  # the prefill's and one decode step's


def test_the_next_session_in_a_slot_reuses_its_graphs_with_the_same_numbers(float_model: Path) -> None:
    n_layer = GGUFModel(float_model).hparams.n_layer
    runtime = StageRuntime.load(float_model, 0, n_layer, ctx_size=64, kernel=Kernel("ggml"), weight_cache=None)

    def session(session_id: int) -> list[F32]:
        runtime.open_session(session_id)
        outputs = [runtime.forward(session_id, 0, PROMPT[:5])]
        outputs += [runtime.forward(session_id, pos, PROMPT[pos:pos + 1]) for pos in (5, 6)]
        return outputs

    first = session(1)
    built = list(_graphs(runtime)._graphs)
    runtime.close_session(1)
    second = session(2)  # the slot session 1 freed: the same memory, so the same graphs
    assert list(_graphs(runtime)._graphs) == built
    assert all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))
    third = session(3)  # beside session 2, in another slot: graphs of its own, the same numbers
    assert len(_graphs(runtime)._graphs) == 2 * len(built)
    assert all(np.array_equal(a, b) for a, b in zip(first, third, strict=True))
    runtime.close_session(2)
    runtime.forward(3, 7, PROMPT[7:8])
    runtime.open_session(4)  # session 2's slot again, while session 3 has moved on
    assert np.array_equal(runtime.forward(4, 0, PROMPT[:5]), first[0])


@pytest.mark.parametrize(("pos_end", "ctx_size", "keys"), [(1, 2048, 64), (64, 2048, 64), (65, 2048, 128),
                                                           (300, 300, 300), (10, 40, 40), (700, 4096, 704)])
def test_attended_keys_are_the_positions_padded_to_64(pos_end: int, ctx_size: int, keys: int) -> None:
    assert graphs.padded_keys(pos_end, ctx_size) == keys


def _prompts_then_steps(runtime: StageRuntime, sessions: int, *, steps: int, seed: int
                        ) -> tuple[list[np.ndarray], list[int]]:
    """Sessions 0.. with prompts of 3, 8, 13, ... random tokens in one pass, then `steps` decode
    passes of all of them: every pass's output, and the most positions a session held after it."""
    rng = np.random.default_rng(seed)
    ids = list(range(sessions))
    for session in ids:
        runtime.open_session(session)
    lengths = [3 + 5 * s for s in ids]
    outputs = [runtime.forward_many(ids, [0] * sessions, lengths, rng.integers(0, 200, sum(lengths), np.int32))]
    ends = [max(lengths)]
    for step in range(steps):
        positions = [n + step for n in lengths]
        outputs.append(runtime.forward_batch(ids, positions, rng.integers(0, 200, sessions, np.int32)))
        ends.append(max(positions) + 1)
    return outputs, ends


@pytest.mark.parametrize("sessions", [1, 3, graphs.POOLED_MIN_SESSIONS + 1])
def test_the_padding_of_the_attended_keys_changes_no_bit(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sessions: int) -> None:
    """Masked keys add exact zeros: sessions attending apart or pooled, across several padding
    boundaries, give the same bits padded to 64 as to 256 (llama.cpp's padding)."""
    path = write_tiny_model(tmp_path / "pad.gguf", arch="gemma3", n_layer=2)

    def run(pad: int) -> list[np.ndarray]:
        monkeypatch.setattr(graphs, "KV_PAD", pad)
        runtime = StageRuntime.load(path, 0, 2, ctx_size=320, kernel=Kernel("ggml", threads=2), weight_cache=None)
        # the positions pass 64 and 128: three paddings to 64 against one to 256
        return _prompts_then_steps(runtime, sessions, steps=140, seed=7)[0]

    padded_64, padded_256 = run(64), run(256)
    assert all(np.array_equal(a, b) for a, b in zip(padded_64, padded_256, strict=True))


@pytest.mark.parametrize("sessions", [1, 3, graphs.POOLED_MIN_SESSIONS + 1])
def test_values_in_blocks_of_positions_give_one_products_numbers(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sessions: int) -> None:
    """Attention over values in blocks (kv_cache.VALUE_BLOCK) sums one product per block: the bits
    of one product while every session lies within the first block, float32 rounding after that,
    apart and pooled."""
    # Every key visible (no window), F32 weights: ggml then quantizes no activation, so a difference in
    # the sums' last bit is not turned into a step of an int8 code.
    path = write_tiny_model(tmp_path / "blocks.gguf", arch="llama", n_layer=2, quantize=False)

    def run(block: int) -> tuple[list[np.ndarray], list[int], int]:
        monkeypatch.setattr("skippy_zmq.compute.kv_cache.VALUE_BLOCK", block)
        # f32 caches, for the same reason: an f16 cache rounds a value differently now and then
        runtime = StageRuntime.load(path, 0, 2, ctx_size=320, kernel=Kernel("ggml", threads=2), weight_cache=None,
                                    cache_type_k="f32", cache_type_v="f32")
        # past positions 64 and 128: three blocks of 64 against one of 320
        outputs, ends = _prompts_then_steps(runtime, sessions, steps=150, seed=8)
        return outputs, ends, list(_graphs(runtime)._graphs)[-1].value_products

    blocked, ends, products = run(64)
    whole, _, one_product = run(320)
    attending = sessions if sessions < graphs.POOLED_MIN_SESSIONS else 1  # apart, or all pooled at once
    assert (products, one_product) == (3 * attending, attending)  # a layer's value products in the last pass
    for got, expected, end in zip(blocked, whole, ends, strict=True):
        if end <= 64:
            assert np.array_equal(got, expected)
        else:
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * float(np.abs(expected).max()))


def test_caches_with_values_in_the_float_layout_are_refused(float_model: Path) -> None:
    from skippy_zmq.compute.kv_cache import Segment, SessionKV
    from skippy_zmq.errors import ModelLoadError

    hp = GGUFModel(float_model).hparams
    block_graphs = graphs.BlockGraphs(GGUFModel(float_model), 0, 1, threads=1)
    kv = SessionKV(1, 1, hp.n_head_kv, hp.head_dim, 32)
    x = np.zeros((2, hp.n_embd), np.float32)
    with pytest.raises(ModelLoadError, match="values transposed"):
        block_graphs.run(x, [Segment(kv, 0, 2, 0)], np.arange(2))


def test_the_weights_stay_the_files_blocks(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "q8.gguf", arch="gemma3", n_layer=2)
    model = GGUFModel(path)
    hp = model.hparams
    q_dim, kv_dim = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
    shapes = {"attn_q": (q_dim, hp.n_embd), "attn_k": (kv_dim, hp.n_embd), "attn_v": (kv_dim, hp.n_embd),
              "attn_output": (hp.n_embd, q_dim), "ffn_gate": (hp.n_ff, hp.n_embd),
              "ffn_up": (hp.n_ff, hp.n_embd), "ffn_down": (hp.n_embd, hp.n_ff)}
    blocks = sum(model.block_matrix(f"blk.{il}.{name}.weight", shape).data.nbytes
                 for il in range(2) for name, shape in shapes.items())
    norms = 2 * 4 * (4 * hp.n_embd + 2 * hp.head_dim)  # four (n_embd,) and two (head_dim,) float32 norms a layer
    quantized = StageRuntime.load(path, 0, 1, ctx_size=32, kernel=Kernel("ggml"), weight_cache=None)
    second = StageRuntime.load(path, 1, 2, ctx_size=32, kernel=Kernel("ggml"), weight_cache=None)
    assert second.head is not None
    assert quantized.weight_bytes() + second.weight_bytes() - second.head.weight_bytes == blocks + norms
    assert model.tensor_type_name("blk.0.attn_q.weight") == "Q8_0"  # blocks, a quarter of float32's bytes
    dense = StageRuntime.load(path, 0, 1, ctx_size=32, kernel=Kernel("numpy"), weight_cache=None)
    assert quantized.weight_bytes() < dense.weight_bytes() / 2


def _decode_batch(runtime: StageRuntime, sessions: list[int]) -> F32:
    """Prefill each session with a prompt of its own, then one decode row each as one batch."""
    for i, session in enumerate(sessions):
        runtime.open_session(session)
        runtime.forward(session, 0, PROMPT[: 3 + i])
    return runtime.forward_batch(sessions, [3 + i for i in range(len(sessions))],
                                 np.array([300 + i for i in range(len(sessions))], np.int32))


@pytest.mark.parametrize("cache_types", [("f32", "f32"), ("f16", "f16"), ("f16", "f32")])
def test_a_decode_batch_of_pooled_sessions_attends_in_one_view_with_the_same_numbers(
        float_model: Path, monkeypatch: pytest.MonkeyPatch, cache_types: tuple[str, str]) -> None:
    n_layer = GGUFModel(float_model).hparams.n_layer
    sessions = [11, 12, 13, 14, 15, 16]

    def run(min_sessions: int) -> tuple[F32, list[graphs.Layout]]:
        monkeypatch.setattr(graphs, "POOLED_MIN_SESSIONS", min_sessions)
        runtime = StageRuntime.load(float_model, 0, n_layer, ctx_size=64, kernel=Kernel("ggml"), weight_cache=None,
                                    cache_type_k=cache_types[0], cache_type_v=cache_types[1])
        out = _decode_batch(runtime, sessions)
        return out, list(_graphs(runtime)._graphs)

    pooled, pooled_layouts = run(4)
    apart, apart_layouts = run(100)
    assert pooled_layouts[-1].pooled_keys == 64 and pooled_layouts[-1].pool_slots == 6
    assert pooled_layouts[-1].segments == ()  # names no session: any 6 pooled decode rows reuse it
    assert pooled_layouts[-1].cache_types == (cache_types,)
    assert apart_layouts[-1].pooled_keys == 0 and len(apart_layouts[-1].segments) == 6
    np.testing.assert_allclose(pooled, apart, rtol=1e-6, atol=1e-6 * float(np.abs(apart).max()))


def test_sessions_beyond_the_pool_attend_apart(float_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(graphs, "POOL_SLOTS", 4)
    monkeypatch.setattr(GgmlEngine, "pool_slots", 4)
    n_layer = GGUFModel(float_model).hparams.n_layer
    runtime = StageRuntime.load(float_model, 0, n_layer, ctx_size=64, kernel=Kernel("ggml"), weight_cache=None)
    _decode_batch(runtime, [1, 2, 3, 4, 5])  # the fifth has no slot: its own mapping
    layout = list(_graphs(runtime)._graphs)[-1]
    assert (layout.pooled_rows, len(layout.segments)) == (4, 1)  # four pooled, the fifth apart
    runtime.close_session(2)
    runtime.open_session(9)  # takes the freed slot, cleared where session 2 wrote
    assert runtime._kv.get(9).slot is not None and runtime._kv.get(9).slot.index == 1  # type: ignore[union-attr]
    assert not runtime._kv.get(9).keys[0].any()


def _caches(runtime: StageRuntime, sessions: list[int]) -> dict[int, list[tuple[F32, F32]]]:
    """Every session's keys and values (Hkv, ctx, D) per layer, as float32, at full context."""
    out = {}
    for session in sessions:
        kv = runtime._kv.get(session)
        out[session] = [kv.view(layer, 0, kv.ctx_size) for layer in range(len(kv.keys))]
    return out


@pytest.mark.parametrize("cache_types", [("f32", "f32"), ("f16", "f16"), ("f16", "f32")])
def test_a_pass_writes_keys_and_values_where_they_go_and_nowhere_else(
        float_model: Path, monkeypatch: pytest.MonkeyPatch, cache_types: tuple[str, str]) -> None:
    n_layer = GGUFModel(float_model).hparams.n_layer
    sessions = [21, 22, 23, 24, 25]

    def caches(kernel: str, min_sessions: int) -> dict[int, list[tuple[F32, F32]]]:
        monkeypatch.setattr(graphs, "POOLED_MIN_SESSIONS", min_sessions)
        runtime = StageRuntime.load(float_model, 0, n_layer, ctx_size=64, kernel=Kernel(kernel), weight_cache=None,
                                    cache_type_k=cache_types[0], cache_type_v=cache_types[1])
        _decode_batch(runtime, sessions)
        return _caches(runtime, sessions)

    pooled, apart, numpy = caches("ggml", 4), caches("ggml", 100), caches("numpy", 4)
    for i, session in enumerate(sessions):
        held = 3 + i + 1  # the prompt and one decode row
        for layer in range(n_layer):
            for got_pooled, got_apart, want in zip(pooled[session][layer], apart[session][layer],
                                                   numpy[session][layer], strict=True):
                # one write for the pooled rows, one per session otherwise: the same bytes
                assert np.array_equal(got_pooled, got_apart)
                assert not got_apart[:, held:, :].any()  # nothing beyond the session's positions
                scale = float(np.abs(want[:, :held]).max())
                np.testing.assert_allclose(got_apart[:, :held], want[:, :held], atol=3e-3 * scale)


def test_a_pass_over_every_layer_is_one_graph_computation(float_model: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    n_layer = GGUFModel(float_model).hparams.n_layer
    runtime = StageRuntime.load(float_model, 0, n_layer, ctx_size=64, kernel=Kernel("ggml"), weight_cache=None)
    calls: list[int] = []
    compute = ggml.Backend.compute
    monkeypatch.setattr(ggml.Backend, "compute", lambda self, graph: (calls.append(graph), compute(self, graph)))
    runtime.open_session(1)
    runtime.forward(1, 0, PROMPT[:5])
    runtime.forward(1, 5, PROMPT[5:6])
    assert len(calls) == 2


def test_reused_logits_are_the_heads_buffer_and_the_others_a_copy(float_model: Path) -> None:
    n_layer = GGUFModel(float_model).hparams.n_layer
    runtime = StageRuntime.load(float_model, 0, n_layer, ctx_size=64, kernel=Kernel("ggml"), weight_cache=None)
    runtime.open_session(1)
    hidden = runtime.forward(1, 0, PROMPT[:4])
    first = runtime.logits(hidden[:2], reuse=True)
    kept = first.copy()
    again = runtime.logits(hidden[2:], reuse=True)  # as many rows: the same buffer, overwritten
    assert again is first and not np.array_equal(first, kept)
    copied = runtime.logits(hidden[:2])
    assert np.array_equal(copied, kept) and copied is not first
    runtime.logits(hidden[2:], reuse=True)
    assert np.array_equal(copied, kept)  # a copy stays what it was


@pytest.mark.parametrize(("cache_types", "prefill_slot"), [(("f32", "f32"), 5), (("f16", "f16"), 5),
                                                           (("f16", "f16"), 0)])
def test_decode_rows_beside_a_prefill_attend_pooled_with_the_same_numbers_and_caches(
        float_model: Path, monkeypatch: pytest.MonkeyPatch, cache_types: tuple[str, str], prefill_slot: int) -> None:
    n_layer = GGUFModel(float_model).hparams.n_layer
    sessions = [31, 32, 33, 34, 35]

    def run(min_sessions: int) -> tuple[F32, graphs.Layout, dict[int, list[tuple[F32, F32]]]]:
        monkeypatch.setattr(graphs, "POOLED_MIN_SESSIONS", min_sessions)
        runtime = StageRuntime.load(float_model, 0, n_layer, ctx_size=64, kernel=Kernel("ggml"), weight_cache=None,
                                    cache_type_k=cache_types[0], cache_type_v=cache_types[1])
        if prefill_slot == 0:  # its first layer's keys start where the whole pool does
            runtime.open_session(40)
        for i, session in enumerate(sessions):
            runtime.open_session(session)
            runtime.forward(session, 0, PROMPT[: 3 + i])
        if prefill_slot != 0:
            runtime.open_session(40)
        assert runtime._kv.get(40).slot.index == prefill_slot  # type: ignore[union-attr]
        # decode rows, a new session's 6-token prefill in the middle, then more decode rows
        ids = [31, 32, 40, 33, 34, 35]
        counts = [1, 1, 6, 1, 1, 1]
        tokens = np.concatenate([[300, 301], PROMPT[:6], [302, 303, 304]]).astype(np.int32)
        out = runtime.forward_many(ids, [3, 4, 0, 5, 6, 7], counts, tokens)
        return out, list(_graphs(runtime)._graphs)[-1], _caches(runtime, [*sessions, 40])

    pooled, pooled_layout, pooled_caches = run(4)
    apart, apart_layout, apart_caches = run(100)
    assert (pooled_layout.pooled_rows, len(pooled_layout.segments), pooled_layout.pool_slots) == (
        5, 1, 5 + (prefill_slot == 0))
    assert pooled_layout.segments[0][1:3] == (2, 6)  # the prefill's first row and rows
    assert (apart_layout.pooled_rows, len(apart_layout.segments)) == (0, 6)
    np.testing.assert_allclose(pooled, apart, rtol=1e-6, atol=1e-6 * float(np.abs(apart).max()))
    for session, layers in apart_caches.items():
        for (k_pooled, v_pooled), (k_apart, v_apart) in zip(pooled_caches[session], layers, strict=True):
            assert np.array_equal(k_pooled, k_apart) and np.array_equal(v_pooled, v_apart)


def test_the_load_line_says_what_asked_for_huge_pages_and_what_the_process_holds_on_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    class Asked:  # the one field the note reads
        huge_bytes = 0

    note = graphs.BlockGraphs.pages_note.fget  # type: ignore[attr-defined]
    asked = Asked()
    assert note(asked) == ""  # nothing asked (tiny matrices, or SKIPPY_ZMQ_HUGE_PAGES=off): nothing said
    asked.huge_bytes = 3 << 29
    monkeypatch.setattr(graphs.huge_pages, "huge_bytes", lambda: 1 << 30)
    assert note(asked) == "; 1.50 GiB of them asked for huge pages (1.00 GiB of the process is on them)"


@pytest.mark.parametrize("shape", ["qwen3moe-mini", "mixtral-mini"])
@pytest.mark.parametrize("repack", [False, True])
def test_a_row_of_an_expert_layer_computes_its_own_experts_alone_and_in_a_batch(tmp_path: Path, shape: str,
                                                                               repack: bool) -> None:
    # ggml_mul_mat_id groups a pass's rows by the experts they chose and multiplies each expert's rows
    # together: a decode row among 8 sessions gives what it gives alone, up to the summation order of
    # the batch's other products (1e-6 of the largest value measured; a row mixed with another's
    # experts would be off by the value itself). One layer, with a router 8 times wider than the
    # writer's: over 6 layers, such noise swaps one row's 4th and 5th experts at layer 3 (a near tie)
    # and that row parts by 0.04 from there on.
    from skippy_zmq.testing.random_model import SHAPES, TensorPlan, write_random_model

    def sharp_router(plans: list[TensorPlan]) -> list[TensorPlan]:
        return [attrs.evolve(p, sigma=8 * p.sigma) if "ffn_gate_inp" in p.name else p for p in plans]

    path = write_random_model(tmp_path / "moe.gguf", SHAPES[shape], seed=3, output_gain=0.5, edit=sharp_router)
    sessions = list(range(21, 29))

    def load() -> StageRuntime:
        runtime = StageRuntime.load(path, 0, 1, ctx_size=64, kernel=Kernel("ggml", repack=repack),
                                    weight_cache=None)
        for i, session in enumerate(sessions):
            runtime.open_session(session)
            runtime.forward(session, 0, PROMPT[: 3 + i])
        return runtime

    tokens = np.array([300 + 7 * i for i in range(len(sessions))], np.int32)
    batched = load().forward_batch(sessions, [3 + i for i in range(len(sessions))], tokens)
    single = load()
    alone = np.concatenate([single.forward(s, 3 + i, tokens[i:i + 1]) for i, s in enumerate(sessions)])
    scale = float(np.abs(alone).max())
    # The batch's other products take another summation order: ggml's repacked GEMM, and on AVX-512 CPUs
    # its 8-row K-quant kernel for unrepacked matrices too (7e-4 of the largest value measured there).
    assert float(np.abs(batched - alone).max()) < 1e-3 * scale
    assert len({row.tobytes() for row in batched}) == len(sessions)  # each row its own
