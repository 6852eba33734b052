"""A real ``vllm serve`` (its OpenAI server module, CPU build) as a test's child process,
in front of which the upstream engine runs: started on a free port, killed (kill -9 of
its whole process group: the API server and its engine core, as a crashed container)
and started again on the same port; its own ``/metrics`` read as numbers.

The engine settings are the tier's quickest to start (tests/vllm/conftest.py): ~30-60 s
on a two-CPU machine.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil

from service.settings import MODEL_NAME
from tests.servers import free_port
from tests.waiting import wait_until

START_S = 400.0  # a safety net for a start on a loaded machine, not a figure
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


class VllmServe:
    def __init__(self, model_dir: Path, logs: Path) -> None:
        self.model_dir, self.logs = model_dir, logs
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:  # what LASTEVENT_UPSTREAM_URL names
        return f"{self.base}/v1"

    @property
    def log_path(self) -> Path:
        return self.logs / f"vllm-serve-{self.port}-{self.starts}.log"

    def start(self) -> VllmServe:
        """Start it (on the same port as before, if it ran) and wait until it serves."""
        self.starts += 1
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        command += ["--model", str(self.model_dir), "--served-model-name", MODEL_NAME]
        command += ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]
        command += ["--port", str(self.port), "--host", "127.0.0.1"]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
        with open(self.log_path, "wb") as out:  # (the child keeps its own copy)
            self.proc = subprocess.Popen(
                command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        wait_until(self._serves, "vllm serve to serve", timeout=START_S, interval=0.5)
        return self

    def _serves(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.tail()
        try:
            models = httpx.get(f"{self.url}/models", timeout=2)
        except httpx.HTTPError:
            return False
        return models.status_code == 200 and MODEL_NAME in models.text

    def tail(self, n: int = 3000) -> str:
        path = self.log_path
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def _group(self) -> list[psutil.Process]:
        assert self.proc is not None
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def send(self, sig: signal.Signals) -> None:
        """``sig`` to its process group (SIGSTOP / SIGCONT: freeze it, let it go on)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """kill -9 of the API server and its engine core at once; until they are gone."""
        if self.proc is None or self.proc.poll() is not None:
            return
        group = self._group()
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        psutil.wait_procs(group, timeout=60)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        group = self._group()
        os.killpg(self.proc.pid, signal.SIGTERM)
        _, alive = psutil.wait_procs(group, timeout=30)
        if alive:
            self.kill()
        else:
            self.proc.wait()

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.url, name, **labels)

    def running(self) -> int:
        return int(self.metric("vllm:num_requests_running"))

    def held(self) -> int:
        return held(self.url)

    def finished(self) -> int:
        """The requests it finished (stop or length; an aborted one is not counted)."""
        return int(
            self.metric("vllm:request_success_total", finished_reason="stop")
            + self.metric("vllm:request_success_total", finished_reason="length")
        )

    def greedy_chat(self, question: str, max_tokens: int) -> tuple[str, list[int], str]:
        """vLLM's own greedy answer to a one-message chat: its text, ids and finish."""
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": question}],
            "temperature": 0,
            "max_tokens": max_tokens,
            "return_token_ids": True,
        }
        answer = httpx.post(f"{self.url}/chat/completions", json=body, timeout=300)
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        return choice["message"]["content"], choice["token_ids"], choice["finish_reason"]


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples (those with ``labels``) in the ``/metrics`` of the
    server whose base URL (``.../v1``) is ``url``."""
    text = httpx.get(f"{url.removesuffix('/v1')}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        sample = _SAMPLE.match(line)
        if sample is None or sample["name"] != name:
            continue
        have = dict(_LABEL.findall(sample["labels"] or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(sample["value"])
    return total


def held(url: str) -> int:
    """The requests vLLM's engine holds, by its own gauges: running and waiting."""
    running = metric(url, "vllm:num_requests_running")
    return int(running + metric(url, "vllm:num_requests_waiting"))
