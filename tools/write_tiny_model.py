"""Write a small random GGUF model for tests and demos: python3 -m tools.write_tiny_model OUT."""

from __future__ import annotations

import click

from skippy_zmq.model.arch import SUPPORTED_ARCHITECTURES
from skippy_zmq.testing.tiny import write_tiny_model


@click.command()
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--arch", type=click.Choice(SUPPORTED_ARCHITECTURES), default="llama", show_default=True)
@click.option("--n-layer", type=int, default=4, show_default=True)
@click.option("--n-embd", type=int, default=64, show_default=True)
@click.option("--n-head", type=int, default=4, show_default=True)
@click.option("--n-head-kv", type=int, default=2, show_default=True)
@click.option("--n-ff", type=int, default=128, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--sliding-window", type=int, default=8, show_default=True)
@click.option("--no-quantize", is_flag=True, help="store every tensor as F32")
def main(out: str, arch: str, n_layer: int, n_embd: int, n_head: int, n_head_kv: int,
         n_ff: int, seed: int, sliding_window: int, no_quantize: bool) -> None:
    """Write a tiny random ARCH model with a SentencePiece-style vocab to OUT."""
    path = write_tiny_model(out, arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                            n_head_kv=n_head_kv, n_ff=n_ff, seed=seed,
                            quantize=not no_quantize, sliding_window=sliding_window)
    click.echo(f"wrote {path}")


if __name__ == "__main__":
    main()
