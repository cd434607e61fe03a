"""tools/compare_big_oracle.py: how llama-server's answers are read and the two token lists compared
(the runs themselves need the big files and llama-server: docs/BENCHMARKS.md, "The oracle on big shapes")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from tools import compare_big_oracle as tool


def _step(token: int, first: float, second: float) -> dict[str, Any]:
    return {"id": token, "top_logprobs": [{"id": token, "logprob": first}, {"id": token + 1, "logprob": second}]}


def test_server_steps_read_tokens_and_margins_from_the_top_two_logprobs() -> None:
    answer = {"completion_probabilities": [_step(5, -0.1, -0.6), _step(9, -1.0, -1.25)],
              "stop_type": "limit", "timings": {"prompt_ms": 12.0, "predicted_ms": 30.0}}
    steps = tool._server_steps(answer)
    assert steps["tokens"] == [5, 9]
    assert steps["margins"] == [0.5, 0.25]
    assert steps["stop_type"] == "limit"
    assert steps["prompt_ms"] == 12.0


def test_server_steps_take_every_id_from_tokens_when_a_probability_entry_is_left_out() -> None:
    # llama-server gives no entry for a token whose piece ends inside a UTF-8 character.
    answer = {"completion_probabilities": [_step(5, -0.1, -0.6), _step(9, -1.0, -1.25)], "tokens": [5, 7, 9]}
    steps = tool._server_steps(answer)
    assert steps["tokens"] == [5, 7, 9]
    assert steps["margins"] == [0.5, None, 0.25]


def test_server_steps_refuse_an_answer_without_probabilities() -> None:
    with pytest.raises(click.ClickException, match="no completion_probabilities"):
        tool._server_steps({"content": "hi"})


def test_server_steps_name_the_step_that_lacks_logprobs() -> None:
    answer = {"completion_probabilities": [_step(5, -0.1, -0.6), {"id": 7}]}
    with pytest.raises(click.ClickException, match=r"completion_probabilities\[1\].*top_logprobs"):
        tool._server_steps(answer)


def test_differences_list_every_differing_step_with_both_margins() -> None:
    rows = [{"server": {"tokens": [1, 2, 3], "margins": [0.5, 0.01, 0.2]},
             "ours": {"tokens": [1, 7, 3], "margins": [0.5, 0.02, 0.2]}},
            {"server": {"tokens": [4], "margins": [1.0]}, "ours": {"tokens": [4], "margins": [1.0]}}]
    assert tool._differences(rows) == [{"prompt": 0, "step": 1, "server": 2, "ours": 7,
                                        "server_margin": 0.01, "ours_margin": 0.02}]


def test_a_missing_llama_server_is_named_before_anything_starts(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"")
    done = CliRunner().invoke(tool.main, [str(model), "--server-dir", str(tmp_path)])
    assert done.exit_code == 2
    assert f"llama-server not found at {tmp_path / 'llama-server'}; --server-dir or $LLAMA_SERVER_DIR" in done.output


def test_the_prompts_are_the_files_tokens_with_its_bos(tiny_llama_path: Path) -> None:
    ids = tool.prompt_ids(str(tiny_llama_path), len(tool.PROMPTS))
    assert len(ids) == len(tool.PROMPTS) and all(one[0] == 2 and len(one) > 3 for one in ids)  # BOS first
    assert max(map(len, ids)) <= tool.MAX_PROMPT_TOKENS and tool.MAX_PROMPT_TOKENS + 16 <= tool.N_CTX


@pytest.mark.parametrize(("n_layer", "n_stages", "cuts"), [
    (32, 1, [(0, 32)]), (32, 2, [(0, 16), (16, 32)]), (40, 3, [(0, 13), (13, 27), (27, 40)]),
    (48, 4, [(0, 12), (12, 24), (24, 36), (36, 48)]),
])
def test_layer_cuts_are_contiguous_and_nearly_equal(n_layer: int, n_stages: int, cuts: list[tuple[int, int]]) -> None:
    assert tool.layer_cuts(n_layer, n_stages) == cuts


def test_more_stages_than_layers_are_refused() -> None:
    with pytest.raises(click.ClickException, match="--stages 5: expected 1 to the file's 4 layers"):
        tool.layer_cuts(4, 5)
