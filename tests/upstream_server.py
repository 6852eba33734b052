"""A small vLLM-shaped OpenAI-compatible server, run as a process of its own, in front of
one of this project's engines: the upstream the fast tier's upstream-engine tests talk to
(``tests/vllm`` talks to the real ``vllm serve``).

    python -m tests.upstream_server --port P --engine cpu|scripted [--model-dir D]

It serves what the upstream engine's token mode uses, the way vLLM's server does:
``GET /v1/models``; ``GET /metrics`` (Prometheus text: ``vllm:num_requests_running`` and
``vllm:num_requests_waiting``); ``POST /v1/completions``, streamed only, with the prompt
as token ids, ``return_token_ids`` (each chunk's ``choices[0].token_ids``),
``return_tokens_as_token_ids`` logprobs (``top_logprobs`` keyed ``token_id:N``, the
sampled id among them), ``structured_outputs`` and vLLM's sampling fields. A field it
does not implement is a 400, as is a request the engine refuses before its first id
(vLLM validates before it streams). A client that goes away (ASGI ``http.disconnect``)
aborts its engine request, so the running gauge falls to 0.

Faults for tests, by ``POST /_faults`` (each applies to the next ``count`` completions):
``{"refuse": {"count": N, "status": S, "retry_after": "R"}}`` answers S (with
``Retry-After: R`` when given) before anything; ``{"cut": {"count": N, "after": K}}``
closes the connection abruptly after K chunks; ``{"hang": {"count": N, "after": K}}``
sends nothing more after K chunks (until the client leaves). A call takes one of those
two: a hang while one is left, else a cut. ``GET /_faults`` says the
faults left and the completions bodies received so far (``calls``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import msgspec
import uvicorn

from service.settings import MODEL_NAME
from service.stream.logprobs import Sampled
from service.stream.params import SamplingParams, Structured
from service.tokenize import ModelInfo
from workers.engines.base import Engine, EngineError, StepOutput

REPO = Path(__file__).resolve().parents[1]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]

# the request fields of vLLM's /v1/completions this server implements
SAMPLING = (
    *("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "logit_bias"),
    *("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"),
    *("ignore_eos", "stop_token_ids", "logprobs"),
)
FIELDS = frozenset(
    (
        *SAMPLING,
        *("model", "prompt", "stream", "return_token_ids", "skip_special_tokens"),
        *("return_tokens_as_token_ids", "structured_outputs"),
    )
)


class Refused(Exception):
    """A request this server does not take: its status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Upstream:
    """The ASGI app: the routes above over one started engine."""

    def __init__(self, engine: Engine, model: ModelInfo, name: str) -> None:
        self.engine, self.model, self.name = engine, model, name
        self.running = 0  # requests streaming
        self.waiting = 0  # requests before their first step
        self.faults: dict[str, dict[str, Any]] = {}
        self.calls: list[dict[str, Any]] = []

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        route = (scope["method"], scope["path"])
        raw = await _body(receive)
        if route == ("GET", "/v1/models"):
            model = {"id": self.name, "object": "model", "owned_by": "tests", "root": self.name}
            await _json(send, 200, {"object": "list", "data": [model]})
        elif route == ("GET", "/metrics"):
            await _reply(send, 200, self.metrics().encode(), b"text/plain; version=0.0.4")
        elif route == ("POST", "/_faults"):
            self.faults.update(json.loads(raw or b"{}"))
            await _json(send, 200, {"faults": self.faults})
        elif route == ("GET", "/_faults"):
            await _json(send, 200, {"faults": self.faults, "calls": self.calls})
        elif route == ("POST", "/v1/completions"):
            try:
                await self.completions(raw, receive, send)
            except Refused as exc:
                await _error(send, exc.status, str(exc))
        else:
            await _error(send, 404, f"no route {route[0]} {route[1]}")

    def metrics(self) -> str:
        lines = []
        for name, value in (("running", self.running), ("waiting", self.waiting)):
            lines += [
                f"# HELP vllm:num_requests_{name} Number of requests {name}.",
                f"# TYPE vllm:num_requests_{name} gauge",
                f'vllm:num_requests_{name}{{engine="0",model_name="{self.name}"}} {value:.1f}',
            ]
        return "\n".join(lines) + "\n"

    def _take(self, kind: str) -> dict[str, Any] | None:
        """The fault of this kind for this call, if one is left."""
        fault = self.faults.get(kind)
        if not fault or fault.get("count", 0) <= 0:
            return None
        fault["count"] -= 1
        return fault

    async def completions(self, raw: bytes, receive: Receive, send: Send) -> None:
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise Refused(400, f"the body is not JSON: {exc}") from exc
        self.calls.append(body)
        refuse = self._take("refuse")
        if refuse is not None:
            after = refuse.get("retry_after")
            headers = [] if after is None else [(b"retry-after", str(after).encode())]
            await _error(send, int(refuse.get("status", 503)), "injected refusal", headers)
            return
        prompt, params = self.parse(body)
        hang = self._take("hang")  # (one of the two per call: a hang first)
        cut = None if hang is not None else self._take("cut")
        rid = f"cmpl-{uuid.uuid4().hex}"
        steps = self.engine.generate(rid, prompt, params)
        gone = asyncio.Event()
        watcher = asyncio.create_task(self._watch(receive, rid, gone))
        self.waiting += 1
        started = False
        # the head at once, as vLLM's server sends it (before the first token: a client
        # tells a server that lives and queues from one that hangs)
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        try:
            try:
                first = await anext(steps)
            except EngineError as exc:  # (past what parse() checks: an error in the stream)
                await _chunk(send, json.dumps({"error": {"message": str(exc), "code": 400}}))
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            self.waiting, self.running, started = self.waiting - 1, self.running + 1, True
            limit = int((hang or cut or {"after": 1 << 30})["after"])
            if await self._stream(send, rid, prompt, params, first, steps, limit):
                await _chunk(send, "[DONE]")
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            elif hang is not None:
                await self.engine.abort(rid)  # (it says nothing more: the answer is not needed)
                await gone.wait()  # until the client gives up on it
            # else a cut: returning mid-response makes uvicorn close the connection
        finally:
            watcher.cancel()
            await steps.aclose()
            if started:
                self.running -= 1
            else:
                self.waiting -= 1

    async def _stream(
        self,
        send: Send,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        step: StepOutput,
        steps: AsyncGenerator[StepOutput, None],
        limit: int,
    ) -> bool:
        """The chunks, up to ``limit`` of them; whether the answer's last one was sent."""
        sent = 0
        while sent < limit:
            choice: dict[str, Any] = {
                "index": 0,
                "text": self.model.decode(step.token_ids, skip_special_tokens=False),
                "logprobs": _logprobs(step, params),
                "finish_reason": None if step.finish_reason is None else str(step.finish_reason),
                "stop_reason": None,
                "token_ids": step.token_ids,
            }
            if sent == 0:
                choice["prompt_token_ids"] = prompt
            chunk = {"id": rid, "object": "text_completion", "created": int(time.time())}
            chunk |= {"model": self.name, "choices": [choice]}
            await _chunk(send, json.dumps(chunk))
            sent += 1
            if step.finished:
                return True
            step = await anext(steps)
        return False

    async def _watch(self, receive: Receive, rid: str, gone: asyncio.Event) -> None:
        """The client went away: abort its engine request (vLLM's server does)."""
        while (await receive())["type"] != "http.disconnect":
            pass
        gone.set()
        await self.engine.abort(rid)

    def parse(self, body: Any) -> tuple[list[int], SamplingParams]:
        if not isinstance(body, dict):
            raise Refused(400, "the body is not a JSON object")
        unknown = sorted(set(body) - FIELDS)
        if unknown:
            raise Refused(400, f"this test server does not implement {unknown}")
        if body.get("model") != self.name:
            raise Refused(404, f"The model `{body.get('model')}` does not exist.")
        if body.get("stream") is not True:
            raise Refused(400, "this test server streams only (stream: true)")
        if body.get("return_token_ids") is not True:
            raise Refused(400, "this test server answers with token ids only")
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not all(type(t) is int for t in prompt):
            raise Refused(400, "prompt: this test server takes token ids only")
        vocab = self.model.tokenizer.get_vocab_size(with_added_tokens=True)
        if not prompt or not all(0 <= t < vocab for t in prompt):  # (vLLM's 400s)
            raise Refused(400, f"prompt: empty, or an id out of the vocabulary ({vocab})")
        if body.get("logprobs") is not None and not body.get("return_tokens_as_token_ids"):
            raise Refused(400, "logprobs: this test server spells tokens as token_id:N only")
        fields = {k: body[k] for k in SAMPLING if body.get(k) is not None}
        if "logit_bias" in fields:
            fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
        structured = body.get("structured_outputs")
        if structured is not None:
            fields["structured"] = _structured(structured)
        try:
            return prompt, msgspec.convert(fields, SamplingParams)
        except msgspec.ValidationError as exc:
            raise Refused(400, str(exc)) from exc


def _structured(spec: Any) -> Structured:
    if spec == {"json_object": True}:
        return Structured(kind="json_object")
    if isinstance(spec, dict) and set(spec) == {"json"}:
        schema = spec["json"]
        return Structured(
            kind="json_schema", schema=schema if isinstance(schema, str) else json.dumps(schema)
        )
    raise Refused(400, f"structured_outputs: this test server implements json only: {spec}")


def _logprobs(step: StepOutput, params: SamplingParams) -> dict[str, Any] | None:
    """vLLM's completions logprobs with ``return_tokens_as_token_ids``."""
    if params.logprobs is None or step.logprobs is None:
        return None

    def top(token: int, sampled: Sampled) -> dict[str, float]:
        return {f"token_id:{t}": lp for t, lp in (*sampled.top, (token, sampled.logprob))}

    pairs = list(zip(step.token_ids, step.logprobs, strict=True))
    return {
        "text_offset": [0] * len(pairs),
        "token_logprobs": [s.logprob for _, s in pairs],
        "tokens": [f"token_id:{t}" for t, _ in pairs],
        "top_logprobs": [top(t, s) for t, s in pairs],
    }


async def _body(receive: Receive) -> bytes:
    raw = b""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return raw
        raw += bytes(message.get("body", b""))
        if not message.get("more_body"):
            return raw


async def _chunk(send: Send, data: str) -> None:
    await send(
        {"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True}
    )


async def _reply(
    send: Send, status: int, body: bytes, kind: bytes, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    head = [(b"content-type", kind), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


async def _json(send: Send, status: int, value: Any) -> None:
    await _reply(send, status, json.dumps(value).encode(), b"application/json")


async def _error(
    send: Send, status: int, message: str, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    error = {"object": "error", "message": message, "type": "BadRequestError", "code": status}
    await _reply(send, status, json.dumps(error).encode(), b"application/json", headers)


def build_engine(args: argparse.Namespace, model: ModelInfo) -> Engine:
    if args.engine == "scripted":
        from workers.engines.scripted import ScriptedEngine

        return ScriptedEngine(model, tokens_per_s=args.tokens_per_s)
    from workers.engines.cpu import CpuEngine

    return CpuEngine(args.model_dir, eos_token_ids=model.eos_token_ids, threads=args.threads)


async def serve(args: argparse.Namespace) -> None:
    model = ModelInfo.load(args.model_dir)
    engine = build_engine(args, model)
    await engine.start()
    app = Upstream(engine, model, args.model_name)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=args.port, lifespan="off", log_level="warning"
    )
    try:
        await uvicorn.Server(config).serve()
    finally:
        await engine.close()


class ServerProcess:
    """This server as a test's child process, on a free port: ``kill`` (SIGKILL) and
    ``start`` again on the same port; its gauges and faults over HTTP."""

    def __init__(
        self,
        logs: Path,
        model_dir: Path,
        *,
        engine: str = "cpu",
        tokens_per_s: float = 200.0,
        threads: int | None = 1,  # (on a shared, busy machine one thread stalls least)
    ) -> None:
        from tests.servers import free_port

        self.port = free_port()
        self.logs, self.model_dir = logs, model_dir
        self.engine, self.tokens_per_s, self.threads = engine, tokens_per_s, threads
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:  # what LASTEVENT_UPSTREAM_URL names
        return f"{self.base}/v1"

    def start(self) -> ServerProcess:
        from tests.waiting import wait_until

        self.starts += 1
        command = [sys.executable, "-m", "tests.upstream_server", "--port", str(self.port)]
        command += ["--engine", self.engine, "--model-dir", str(self.model_dir)]
        command += ["--tokens-per-s", str(self.tokens_per_s)]
        command += [] if self.threads is None else ["--threads", str(self.threads)]
        with open(self.logs / f"upstream-{self.port}-{self.starts}.log", "wb") as out:
            self.proc = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)

        def ready() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log()
            try:
                return httpx.get(f"{self.url}/models", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, "the upstream test server to answer", timeout=180)
        return self

    def log(self) -> str:
        path = self.logs / f"upstream-{self.port}-{self.starts}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def gauges(self) -> dict[str, float]:
        """``vllm:num_requests_*`` by the part after it: running, waiting."""
        text = httpx.get(f"{self.base}/metrics", timeout=5).text
        found = (line.split() for line in text.splitlines() if line.startswith("vllm:"))
        return {
            name.split("{")[0].removeprefix("vllm:num_requests_"): float(v) for name, v in found
        }

    def held(self) -> int:
        gauges = self.gauges()
        return int(gauges["running"] + gauges["waiting"])

    def faults(self, **spec: dict[str, Any]) -> None:
        httpx.post(f"{self.base}/_faults", json=spec, timeout=5).raise_for_status()

    def calls(self) -> list[dict[str, Any]]:
        """The completions bodies it received, in order."""
        return list(httpx.get(f"{self.base}/_faults", timeout=5).json()["calls"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engine", choices=("cpu", "scripted"), default="cpu")
    parser.add_argument("--model-dir", type=Path, default=REPO / ".cache" / "models" / MODEL_NAME)
    parser.add_argument("--model-name", default=MODEL_NAME)
    parser.add_argument("--tokens-per-s", type=float, default=200.0)  # (scripted)
    parser.add_argument("--threads", type=int, default=None)  # (cpu: torch's; None: its own)
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
