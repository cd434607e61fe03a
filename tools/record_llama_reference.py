"""Record llama.cpp reference outputs for Gemma 3 270M (run by hand, never by CI):

    python3 -m tools.record_llama_reference [--model GGUF] [--out-dir DIR] [--work-dir DIR]

Writes, into --out-dir (default: this checkout's tests/data/llama_cpp):
  gemma3_prompts.json    prompt ids, 24 greedy ids on the F32 model, Q4_K_M top token, sliding-window case
  gemma3_logits.npz      f32_last_{i}, q4_last_{i} (float32 (n_vocab,)), sliding_f32 (float32 (P, n_vocab))
  gemma3_tokenizer.json  llama.cpp token ids (add_bos=False, special=False) for tokenizer edge cases

The F32 model is the Q4_K_M file with every tensor dequantized by gguf.quants.dequantize and all
metadata copied (`_common.f32_copy`, kept in --work-dir); llama.cpp runs it with an F32 KV cache
(type_k = type_v = 0) on 2 threads.
`sliding.positions` are indices into `sliding.prompt_ids`: row k of `sliding_f32` holds the logits
predicting the token after `prompt_ids[positions[k]]`.

Needs llama-cpp-python (`pip install skippy-zmq[oracle]`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from skippy_zmq.model.catalog import cache_dir, ensure_gemma3_270m
from tools._common import f32_copy

REPO = Path(__file__).resolve().parent.parent

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "List of planets in the solar system: Mercury,",
)
N_GREEDY = 24
SLIDING_POSITIONS = (520, 560, 600)
SEED = 1234
N_CTX = 1024

TOKENIZER_CASES = (
    "",
    " ",
    "  ",
    "   leading spaces",
    "trailing spaces   ",
    "a      b",
    " " * 40,
    "\n",
    "\n\n\n",
    "line one\nline two\n\nline four",
    "\t",
    "\t\tindented\twith\ttabs",
    "windows\r\nline\r\nendings\r\n",
    " \t \n \r\n\t\t  \n\n  mixed",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "东京是日本的首都。",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 문장입니다.",
    "😀 smile",
    "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👍🏽 thumbs",
    "Crème brûlée, naïve café, Ångström, façade",
    "Ünïcödé äöü ß ÄÖÜ",
    "مرحبا بالعالم",
    "שלום עולם",
    "Привет, как дела?",
    "नमस्ते दुनिया",
    "<start_of_turn>user\nhi<end_of_turn>",
    "<start_of_turn>model\n",
    "<bos><eos><pad><unk>",
    "<table><tr><td>cell</td></tr></table>",
    "https://example.com/path/to/page?query=1&lang=en#section",
    "def add(a, b):\n    return a + b\n",
    'int main(void) {\n\tprintf("%d\\n", 42);\n\treturn 0;\n}',
    "for (int i = 0; i < n; ++i) { sum += x[i]; }",
    "1234567890 3.14159 -2.5e-10 1,000,000",
    "2026-11-30T10:45:00Z",
    "supercalifragilisticexpialidocious",
    "pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism",
    "𠀀𠀁𪚥",
    "\ue000\uf8ff private use",
    "\x00\x01\x07\x1b control chars",
    "\u200b\u200d\ufeff invisible",
    "¡¿¬±×÷€£¥©®™",
    "∀x∈ℝ: x² ≥ 0",
    "<0x41> literal byte text",
    "▁ already escaped ▁▁",
    "ALL CAPS SHOUTING AND MiXeD CaSe",
    "email: someone@example.org, tag #python @user",
)


# Alphabets for the generated tokenizer cases: every script, whitespace kind and special-looking text above.
_FUZZ_POOLS = (
    "abcdefghijklmnopqrstuvwxyz", "ABCXYZ", "0123456789", " ", "  \n\t\r",
    ".,;:!?()[]{}<>_-+=*/\\\"'`#@$%^&|~", "éèêëàâäöüßçñøå", "中文字符日本語한국어",
    "😀👍🏽\u200d❤️🌈👨\u200d👩\u200d👧", "абвгдежзийклмн", "ابتثجحخ", "אבגדה", "कखगघङ",
    "\x00\x01\x1f\x7f\xa0\u200b\ue000\U000f0000\U00020000",
)
_FUZZ_WORDS = ("▁", "<start_of_turn>", "<end_of_turn>", "<0x41>", "<unused5>", "<td>", "\n\n\n", "     ", " the", "ing")
N_FUZZ_CASES = 120


def _fuzz_cases() -> list[str]:
    """Deterministic random strings mixing the pools and words above."""
    rng = random.Random(SEED)
    cases = []
    for _ in range(N_FUZZ_CASES):
        parts = []
        for _ in range(rng.randint(1, 40)):
            parts.append(rng.choice(rng.choice(_FUZZ_POOLS)) if rng.random() < 0.85 else rng.choice(_FUZZ_WORDS))
        cases.append("".join(parts))
    return cases


def _sliding_text() -> str:
    """Deterministic natural-ish text well over 600 Gemma tokens."""
    subjects = ["The old lighthouse keeper", "A young botanist", "The village baker", "An elderly sailor",
                "The river merchant", "A curious student", "The night watchman", "A travelling musician"]
    verbs = ["walked slowly along", "wrote a long letter about", "remembered the story of",
             "carefully studied", "quietly sang about", "drew a small map of", "argued with a friend about"]
    objects = ["the northern coast", "the rainy season in the valley", "a ship that never returned",
               "the market square at dawn", "the strange lights above the hills", "an abandoned railway",
               "the history of the harbour", "a garden full of rare herbs"]
    endings = ["before the sun went down.", "while the wind grew colder.", "and nobody said a word.",
               "as the bells rang in the distance.", "until the candles burned out.",
               "because the winter had been long."]
    rng = random.Random(SEED)
    sentences = [
        f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(endings)}" for _ in range(38)
    ]
    paragraphs = [" ".join(sentences[i : i + 7]) for i in range(0, len(sentences), 7)]
    return "\n\n".join(paragraphs)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _open(path: Path, n_ctx: int) -> Any:
    from llama_cpp import Llama

    return Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        n_batch=512,
        n_threads=2,
        n_threads_batch=2,
        type_k=0,
        type_v=0,
        logits_all=True,
        seed=SEED,
        verbose=False,
    )


def _eval_logits(llm: Any, ids: Sequence[int]) -> npt.NDArray[np.float32]:
    """Fresh context, evaluate `ids`; float32 (len(ids), n_vocab) logits of every position."""
    llm.reset()  # the next eval() drops every cached position
    llm.eval(list(ids))
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def _greedy(llm: Any, prompt_ids: Sequence[int], n_new: int) -> tuple[npt.NDArray[np.float32], list[int]]:
    """Last-position prompt logits and `n_new` argmax tokens, feeding one token at a time."""
    logits = _eval_logits(llm, prompt_ids)
    last = logits[-1].copy()
    generated: list[int] = []
    row = last
    for _ in range(n_new):
        token = int(np.argmax(row))
        generated.append(token)
        llm.eval([token])
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    return last, generated


def _write_outputs(out_dir: Path, prompts_doc: dict[str, Any], arrays: dict[str, npt.NDArray[np.float32]]) -> None:
    """Write gemma3_prompts.json and gemma3_logits.npz (each via a temporary file, then renamed)."""
    json_tmp = out_dir / "gemma3_prompts.json.tmp"
    json_tmp.write_text(json.dumps(prompts_doc, indent=1) + "\n")
    json_tmp.replace(out_dir / "gemma3_prompts.json")
    npz_tmp = out_dir / "gemma3_logits.tmp.npz"
    np.savez_compressed(npz_tmp, **arrays)
    npz_tmp.replace(out_dir / "gemma3_logits.npz")


def main(argv: Sequence[str] | None = None) -> int:
    """Record all references; returns the process exit code."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None,
                        help="Gemma 3 270M Q4_K_M GGUF (default: assembled into --work-dir)")
    parser.add_argument("--out-dir", type=Path, default=REPO / "tests" / "data" / "llama_cpp")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where the model and its F32 copy are kept (default: $SKIPPY_ZMQ_CACHE or "
                             "~/.cache/skippy-zmq)")
    args = parser.parse_args(argv)

    work_dir: Path = (args.work_dir or cache_dir()).expanduser()
    work_dir.mkdir(parents=True, exist_ok=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    model: Path = args.model or ensure_gemma3_270m(work_dir)
    f32_path = f32_copy(model, work_dir, say=print)

    import llama_cpp

    prompt_records: list[dict[str, Any]] = []
    arrays: dict[str, npt.NDArray[np.float32]] = {}
    llm_q4 = _open(model, N_CTX)
    for i, prompt in enumerate(PROMPTS):
        ids = list(map(int, llm_q4.tokenize(prompt.encode(), add_bos=True, special=False)))
        q4_last = _eval_logits(llm_q4, ids)[-1]
        arrays[f"q4_last_{i}"] = q4_last
        prompt_records.append({"prompt": prompt, "prompt_ids": ids, "top_token_q4": int(np.argmax(q4_last))})
    del llm_q4

    llm = _open(f32_path, N_CTX)
    print(f"llama.cpp {llama_cpp.__version__} loaded {f32_path.name}: n_vocab {llm.n_vocab()}")
    tokenizer_cases = [
        {"text": text, "ids": list(map(int, llm.tokenize(text.encode(), add_bos=False, special=False)))}
        for text in (*TOKENIZER_CASES, *_fuzz_cases())
    ]
    tokenizer_tmp = args.out_dir / "gemma3_tokenizer.json.tmp"
    tokenizer_tmp.write_text(json.dumps({"cases": tokenizer_cases}, indent=1, ensure_ascii=False) + "\n")
    tokenizer_tmp.replace(args.out_dir / "gemma3_tokenizer.json")
    for i, record in enumerate(prompt_records):
        last, greedy = _greedy(llm, record["prompt_ids"], N_GREEDY)
        arrays[f"f32_last_{i}"] = last
        record["greedy_ids_f32"] = greedy
        print(f"f32 {record['prompt']!r}: {llm.detokenize(greedy).decode(errors='replace')!r}")
    prompts_doc: dict[str, Any] = {
        "model": model.name,
        "model_sha256": _sha256(model),
        "llama_cpp_version": llama_cpp.__version__,
        "prompts": [
            {key: record[key] for key in ("prompt", "prompt_ids", "greedy_ids_f32", "top_token_q4")}
            for record in prompt_records
        ],
        "sliding": {"prompt_ids": [], "positions": []},
    }
    # Written twice: the prompt part first, so its users need not wait for the sliding case.
    _write_outputs(args.out_dir, prompts_doc, arrays)

    sliding_ids = list(map(int, llm.tokenize(_sliding_text().encode(), add_bos=True, special=False)))
    if not SLIDING_POSITIONS[-1] < len(sliding_ids) - 1 < N_CTX:
        raise SystemExit(f"sliding prompt has {len(sliding_ids)} tokens; expected {SLIDING_POSITIONS[-1] + 2}..{N_CTX}")
    positions = [*SLIDING_POSITIONS, len(sliding_ids) - 1]
    arrays["sliding_f32"] = np.ascontiguousarray(_eval_logits(llm, sliding_ids)[positions])
    prompts_doc["sliding"] = {"prompt_ids": sliding_ids, "positions": positions}
    _write_outputs(args.out_dir, prompts_doc, arrays)
    print(f"wrote {args.out_dir}: {len(prompt_records)} prompts, {len(tokenizer_cases)} tokenizer cases, "
          f"sliding prompt of {len(sliding_ids)} tokens at {positions}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
