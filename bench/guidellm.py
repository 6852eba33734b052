"""GuideLLM, unmodified, against lastevent + a vLLM worker and against vLLM's own OpenAI
server: same model, same engine settings, same synthetic data, one after the other.

For each system: a short run through a recording proxy (every request's method, path,
status and JSON body fields, so what GuideLLM sends is on record), then the measured
run straight to the server. Prints the exact guidellm command lines, the fields seen
and a table of GuideLLM's own medians (TTFT, ITL, request latency) and throughputs
with the ratio lastevent / vLLM. GuideLLM's JSON reports and the logs stay in --out.

    make bench-guidellm      # or: .venv-vllm/bin/python -m bench.guidellm --help

Runs under the vLLM venv (it starts vLLM's server and the lastevent roles with its
python); guidellm itself comes from its own venv (--guidellm, `make bench-guidellm`
creates it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from bench.common import free_port
from bench.vllm_compare import MODEL, lastevent_stack, vllm_server

REPO = Path(__file__).resolve().parents[1]
SYSTEMS = ["vllm", "lastevent"]
_HOP = {b"host", b"content-length", b"transfer-encoding", b"connection", b"keep-alive"}


class Recorder:
    """An ASGI pass-through proxy to ``upstream`` that records each request's method,
    path, status and (JSON) body; responses are relayed chunk by chunk (SSE included)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.seen: list[dict[str, Any]] = []
        self._client: httpx.AsyncClient | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if self._client is None:
            self._client = httpx.AsyncClient(base_url=self.upstream, timeout=600)
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP]
        query = scope.get("query_string", b"").decode()
        url = scope["path"] + (f"?{query}" if query else "")
        request = self._client.build_request(scope["method"], url, headers=headers, content=body)
        response = await self._client.send(request, stream=True)
        entry: dict[str, Any] = {
            "method": scope["method"],
            "path": scope["path"],
            "status": response.status_code,
        }
        if body:
            with contextlib.suppress(ValueError):
                entry["body"] = json.loads(body)
        self.seen.append(entry)
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": [(k, v) for k, v in response.headers.raw if k.lower() not in _HOP],
                }
            )
            chunks = []
            async for chunk in response.aiter_raw():
                if response.status_code >= 400:
                    chunks.append(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            if chunks:
                entry["error"] = b"".join(chunks).decode(errors="replace")[:500]
        finally:
            await response.aclose()


@contextlib.contextmanager
def recording(upstream: str) -> Iterator[tuple[str, Recorder]]:
    """``(proxy URL, recorder)``: the proxy runs in a thread of this process."""
    recorder = Recorder(upstream)
    port = free_port()
    config = uvicorn.Config(
        recorder, host="127.0.0.1", port=port, log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="recorder", daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", recorder
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def guidellm_command(
    guidellm: Path, target: str, model_dir: Path, out: Path, args: argparse.Namespace, requests: int
) -> list[str]:
    """The one command line both systems get (only --backend's target differs)."""
    backend = f"kind=openai_http,target={target},model={MODEL},request_format={args.format}"
    return [
        str(guidellm),
        "run",
        "--backend",
        backend,
        "--tokenizer",
        f"kind=hf_auto,model={model_dir}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
        "--profile",
        "kind=synchronous" if args.rate is None else f"kind=constant,rate={args.rate}",
        "--constraint",
        f"kind=max_requests,count={requests}",
        "--constraint",
        f"kind=max_duration,seconds={args.max_seconds}",
        "--output",
        f"kind=json,path={out}",
        "--disable-console-interactive",
    ]


def run_guidellm(cmd: list[str], log: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(log, "wb") as out:
        done = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"guidellm exited with {done.returncode}: {log}")


def fields(seen: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method + path: the statuses answered and every JSON field path sent."""
    out: dict[str, Any] = {}
    for entry in seen:
        where = out.setdefault(
            f"{entry['method']} {entry['path']}", {"statuses": set(), "fields": set()}
        )
        where["statuses"].add(entry["status"])
        if "error" in entry:
            where.setdefault("errors", set()).add(entry["error"])
        where["fields"].update(_paths(entry.get("body")))
    return out


def _paths(value: Any, prefix: str = "") -> set[str]:
    if isinstance(value, dict):
        found = set()
        for k, v in value.items():
            found |= {f"{prefix}{k}"} | _paths(v, f"{prefix}{k}.")
        return found
    if isinstance(value, list):
        return set().union(*(_paths(v, prefix.rstrip(".") + "[].") for v in value))
    return set()


def metrics(report: Path) -> dict[str, float]:
    """GuideLLM's own figures for its one benchmark: medians in ms, rates per second."""
    bench = json.loads(report.read_text())["benchmarks"][0]
    m = bench["metrics"]

    def median(name: str) -> float:
        return float(m[name]["successful"]["median"])

    def mean(name: str) -> float:
        return float(m[name]["successful"]["mean"])

    return {
        "TTFT median (ms)": median("time_to_first_token_ms"),
        "ITL median (ms)": median("inter_token_latency_ms"),
        "request latency median (s)": median("request_latency"),
        "requests/s (mean)": mean("requests_per_second"),
        "output tokens/s (mean)": mean("output_tokens_per_second"),
        "output tokens per request (mean)": mean("output_token_count"),
        "successful requests": float(bench["scheduler_metrics"]["requests_made"]["successful"]),
        "errored requests": float(bench["scheduler_metrics"]["requests_made"]["errored"]),
    }


def one_system(
    name: str, url: str, args: argparse.Namespace, out: Path
) -> tuple[dict[str, float], dict[str, Any]]:
    with recording(url) as (proxy, recorder):
        probe = guidellm_command(
            args.guidellm, proxy, args.model_dir, out / f"{name}-recorded.json", args, 3
        )
        run_guidellm(probe, out / f"{name}-recorded.log")
    (out / f"{name}-requests.json").write_text(json.dumps(recorder.seen, indent=1))
    cmd = guidellm_command(
        args.guidellm, url, args.model_dir, out / f"{name}.json", args, args.requests
    )
    print(f"{name}: {shlex.join(cmd)}", flush=True)
    run_guidellm(cmd, out / f"{name}.log")
    return metrics(out / f"{name}.json"), fields(recorder.seen)


def table(results: dict[str, dict[str, float]]) -> str:
    rows = [
        "| metric (GuideLLM) | vLLM server | lastevent | lastevent / vLLM |",
        "| --- | --- | --- | --- |",
    ]
    for key, v in results["vllm"].items():
        le = results["lastevent"][key]
        ratio = f"{le / v:.2f}" if v else "-"
        rows.append(f"| {key} | {v:.4g} | {le:.4g} | {ratio} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=REPO / ".cache/models" / MODEL)
    parser.add_argument("--guidellm", type=Path, default=REPO / ".venv-guidellm/bin/guidellm")
    parser.add_argument("--format", default="/v1/chat/completions")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--max-seconds", type=int, default=180)
    parser.add_argument("--rate", type=float, help="constant requests/s (default: synchronous)")
    parser.add_argument("--systems", nargs="+", choices=["vllm", "lastevent"], default=SYSTEMS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-guidellm-"))
    out.mkdir(parents=True, exist_ok=True)
    # no ledger here (lastevent_stack drops the database URL): no API keys either
    os.environ.setdefault("LASTEVENT_AUTH", "off")
    os.environ.setdefault("LASTEVENT_DURABILITY", "memory")  # the local Redis has no AOF
    redis_url = os.environ.get("LASTEVENT_REDIS_URL", "redis://127.0.0.1:6379/0")
    results: dict[str, dict[str, float]] = {}
    seen: dict[str, dict[str, Any]] = {}
    if "vllm" in args.systems:
        with vllm_server(args.model_dir, out / "vllm-server.log") as url:
            results["vllm"], seen["vllm"] = one_system("vllm", url, args, out)
    if "lastevent" in args.systems:
        with lastevent_stack(args.model_dir, redis_url, out) as url:
            results["lastevent"], seen["lastevent"] = one_system("lastevent", url, args, out)
    print()
    for name, routes in seen.items():
        print(f"{name}: what GuideLLM sent (recorded run)")
        for route, what in routes.items():
            print(f"  {route} -> {sorted(what['statuses'])}: {', '.join(sorted(what['fields']))}")
            for error in sorted(what.get("errors", ())):
                print(f"    error: {error}")
    print()
    print(table(results) if len(results) == 2 else json.dumps(results, indent=1))
    print(f"\nreports and logs in {out}")


if __name__ == "__main__":
    main()
