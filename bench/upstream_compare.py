"""Clients -> vLLM's own server directly, vs clients -> lastevent -> the same vLLM server
(lastevent's upstream engine in token mode): TTFT, inter-token latency, and the CPU
lastevent's processes add per 1,000 delivered tokens.

One ``vllm serve`` (its OpenAI API server module, on CPU) does the work for both; they
are loaded in turn, round after round (A B, then B A), and each figure is the median of
the rounds with each round's ratio. CPU per 1,000 tokens is per process: vLLM's API
server (in both: behind lastevent it still serves every token), and lastevent's API,
worker and Redis (a Redis of this run's own at ``--durability``).

    make bench-upstream        # or: .venv-vllm/bin/python -m bench.upstream_compare --help
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from bench.vllm_compare import (
    MODEL,
    Rounds,
    Run,
    System,
    arguments,
    at_rest,
    interleaved,
    lastevent_stack,
    latency_table,
    vllm_server,
)
from tests.servers import OwnRedis

VLLM_SERVER = "vLLM API server"
LASTEVENT = ("lastevent API", "lastevent worker", "Redis")


def upstream_worker(vllm: System) -> dict[str, str]:
    """A worker in front of ``vllm`` in token mode (the model dir: its tokenizer, template)."""
    return {
        "LASTEVENT_ENGINE": "upstream",
        "LASTEVENT_UPSTREAM_URL": vllm.url + "/v1",
        "LASTEVENT_UPSTREAM_MODEL": MODEL,
    }


def cpu_table(rounds: Rounds) -> str:
    rows = [
        "| concurrency | vLLM API server, direct | vLLM API server, behind lastevent | "
        "lastevent API | lastevent worker | Redis | lastevent in all |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c, runs in rounds.items():

        def med(system: str, process: str, runs: dict[str, list[Run]] = runs) -> float:
            return statistics.median(r.cpu_ms_per_1k(process) for r in runs[system])

        total = statistics.median(
            sum(r.cpu_ms_per_1k(p) for p in LASTEVENT) for r in runs["lastevent"]
        )
        cells = [med("vLLM", VLLM_SERVER), med("lastevent", VLLM_SERVER)]
        cells += [med("lastevent", p) for p in LASTEVENT] + [total]
        rows.append(f"| {c} | " + " | ".join(f"{x:.0f}" for x in cells) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = arguments(__doc__, [1, 8, 32])
    parser.add_argument("--idle-seconds", type=float, default=10)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="bench-upstream-"))
    own = OwnRedis(
        logs / "redis", appendfsync="always" if args.durability == "disk" else "everysec"
    )
    rounds: Rounds = {c: {"vLLM": [], "lastevent": []} for c in args.concurrency}
    own.start()
    try:
        with (
            vllm_server(args.model_dir, logs / "vllm-server.log") as vllm,
            lastevent_stack(
                args.model_dir,
                own.url,
                logs,
                args.durability,
                upstream_worker(vllm),
                {VLLM_SERVER: vllm.pids[VLLM_SERVER]},
            ) as lastevent,
        ):
            rest = at_rest((lastevent,), args.idle_seconds)
            interleaved((vllm, lastevent), args, rounds)
    finally:
        own.stop()
    print()
    print(latency_table(rounds).replace("| lastevent (ms) |", "| lastevent -> vLLM (ms) |"))
    print("\nCPU ms per 1,000 delivered tokens (medians of the rounds):\n")
    print(cpu_table(rounds))
    print(f"\nCPU at rest, both up and idle for {args.idle_seconds:g} s (ms per second):")
    print("  " + ", ".join(f"{name} {ms:.1f}" for name, ms in rest.items()))
    print(
        f"\n{args.rounds} rounds, {args.per_client} requests per client, max_tokens "
        f"{args.max_tokens}; lastevent at {args.durability}; logs in {logs}"
    )


if __name__ == "__main__":
    main()
