"""The built-in turn formats: every architecture row names one, and each renders a conversation in the
gateway's sandbox with its family's markers."""

from __future__ import annotations

import pytest

from skippy_zmq.gateway.chat import ChatTemplate
from skippy_zmq.model import turn_formats
from skippy_zmq.model.arch import ARCHITECTURES
from tests.gateway.test_chat import TOK

MARKERS = {turn_formats.GEMMA_TURNS: ("<start_of_turn>user\n", "<start_of_turn>model\n"),
           turn_formats.LLAMA2_INST: ("[INST] <<SYS>>\n", " [/INST]"),
           turn_formats.CHATML: ("<|im_start|>system\nBe brief.<|im_end|>\n", "<|im_start|>user\nHi<|im_end|>\n",
                                 "<|im_start|>assistant\n")}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_each_row_falls_back_to_a_format_that_renders(arch: str) -> None:
    spec = ARCHITECTURES[arch]
    assert spec.chat_fallback in MARKERS
    template = ChatTemplate.for_family(arch, TOK)
    assert template.is_fallback and template.source == spec.chat_fallback
    text = template.render_text([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert "Be brief." in text and "Hi" in text
    assert all(marker in text for marker in MARKERS[spec.chat_fallback])
