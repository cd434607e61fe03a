"""Write a GGUF of a real model's shape with random weights in llama.cpp's Q4_K_M (or --mix Q8_0, Q4_0) type mix:
python3 -m tools.write_random_model --shape gemma3-12b --tokenizer-from gemma3-270m-q4_k_m OUT.gguf"""

from __future__ import annotations

import sys
import time

import click

from skippy_zmq.errors import SkippyError
from skippy_zmq.model.catalog import resolve_model
from skippy_zmq.testing.random_model import (
    MIXES,
    OUTPUT_GAIN,
    SHAPES,
    RopeScaling,
    TokenizerKeys,
    mix_named,
    shape_named,
    write_random_model,
)


def _say(text: str) -> None:
    """Progress to stderr, so stdout has only the result line."""
    print(text, file=sys.stderr, flush=True)


@click.command()
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--shape", "shape_name", type=click.Choice(list(SHAPES)), required=True)
@click.option("--tokenizer-from", "tokenizer_from", default=None, metavar="GGUF",
              help="copy every tokenizer.* key from this GGUF (a path or the packaged model's alias); "
                   "default: the tiny test vocab")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--rope-scaling", "rope_scaling", default=None, metavar="none|linear:F|longrope:F|yarn:F[:CONTEXT]",
              help="RoPE scaling keys to write; default: the shape's own (linear:8 for gemma3-4b/12b)")
@click.option("--output-gain", type=float, default=OUTPUT_GAIN, show_default=True,
              help="scale of the output head (Gemma: the tied embedding); see write_random_model")
@click.option("--mix", "mix_name", type=click.Choice(list(MIXES)), default="Q4_K_M", show_default=True,
              help="llama.cpp's type mix: the ggml type llama-quantize gives each tensor for that file type")
def main(out: str, shape_name: str, tokenizer_from: str | None, seed: int, rope_scaling: str | None,
         output_gain: float, mix_name: str) -> None:
    """Write a random-weights GGUF of SHAPE to OUT, tensor by tensor."""
    started = time.perf_counter()
    try:
        shape = shape_named(shape_name)
        tokenizer = None if tokenizer_from is None else TokenizerKeys.copied_from(resolve_model(tokenizer_from))
        scaling: RopeScaling | str | None = "shape" if rope_scaling is None else RopeScaling.parse(rope_scaling)
        path = write_random_model(out, shape, tokenizer=tokenizer, seed=seed, rope_scaling=scaling,
                                  output_gain=output_gain, mix=mix_named(mix_name), progress=_say)
    except SkippyError as exc:
        raise click.ClickException(str(exc)) from None
    size = path.stat().st_size
    click.echo(f"wrote {path}: {size / 1e9:.2f} GB in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
