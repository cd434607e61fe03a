"""How long a running stream stalls while a long prompt arrives (issue: chunked prefill).

Start a server first (e.g. `skippy-zmq serve --stages 1 --port 8099`), then:

    python3 tools/bench_prefill_freeze.py --url http://127.0.0.1:8099

One greedy stream of 150 tokens runs; 1.5 s in, a 1,700-token prompt is sent. Printed: the
stream's inter-token gaps (median, p90, max) and how long the long prompt took.
"""

from __future__ import annotations

import argparse
import threading
import time

from openai import OpenAI


def main() -> None:
    """Run the probe once and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8099")
    parser.add_argument("--model", default="gemma3-270m-q4_k_m")
    args = parser.parse_args()
    client = OpenAI(base_url=f"{args.url}/v1", api_key="unused")
    gaps: list[float] = []

    def stream() -> None:
        last = None
        for _chunk in client.completions.create(model=args.model, prompt="Once upon a time", max_tokens=150,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True}):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now

    thread = threading.Thread(target=stream)
    thread.start()
    time.sleep(1.5)
    started = time.perf_counter()
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 170
    reply = client.completions.create(model=args.model, prompt=long_prompt, max_tokens=4, temperature=0)
    print(f"long prompt: {reply.usage.prompt_tokens} tokens, answered in {time.perf_counter() - started:.2f} s")
    thread.join(120)
    gaps.sort()
    print(f"stream gaps: median {gaps[len(gaps) // 2] * 1000:.0f} ms, p90 {gaps[int(len(gaps) * 0.9)] * 1000:.0f} ms, "
          f"max {gaps[-1] * 1000:.0f} ms, n={len(gaps)}")


if __name__ == "__main__":
    main()
