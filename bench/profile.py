"""Where the milliseconds go: the harness's lastevent stack under load, sampled by py-spy.

Starts the same stack as ``bench/harness.py`` (one worker, one API process, the scripted
engine, the local Redis, no Postgres), attaches ``py-spy record`` to the worker and to the
API process (``--nonblocking --gil``, 100 samples/s: Python on CPU, not its waits),
drives ``--streams`` concurrent streams through it, and prints for each process its
user and system CPU per 1,000 tokens and the functions that were on CPU most, by self
time and by total time (share of the samples), plus Redis's own ``INFO commandstats``
over the run: microseconds per command, per 1,000 delivered tokens.

    .venv/bin/pip install py-spy        # (not a project dependency: a profiling tool)
    .venv/bin/python -m bench.profile --streams 200
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import redis

from bench.clients import MODEL, drive
from bench.harness import REPO, answer_text, lastevent, local_redis, raise_fd_limit


def _frame(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py)``: one name per function."""
    name, _, where = frame.partition(" (")
    path = where.split(":", 1)[0]
    return f"{name} ({Path(path).name})"


def top(raw: Path, n: int) -> tuple[int, list[tuple[str, int]], list[tuple[str, int]]]:
    """py-spy's raw (collapsed) stacks: samples, the top self and the top total frames."""
    self_: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        frames = [_frame(f) for f in stack.split(";") if f.strip()]
        frames = [f for f in frames if not f.startswith("process ")]
        if not frames:
            continue
        samples += k
        self_[frames[-1]] += k
        for f in set(frames):
            total[f] += k
    return samples, self_.most_common(n), total.most_common(n)


def commandstats(url: str) -> dict[str, tuple[int, int]]:
    """Redis's per-command (calls, microseconds) so far."""
    info = redis.Redis.from_url(url).info("commandstats")
    return {
        name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
        for name, v in info.items()
        if isinstance(v, dict)
    }


def py_spy() -> str:
    """py-spy's path, beside this Python or on PATH; exits saying how to install it."""
    here = Path(sys.executable).parent
    spy = shutil.which("py-spy", path=str(here)) or shutil.which("py-spy")
    if spy is None:
        raise SystemExit(f"py-spy is not installed: {here / 'pip'} install py-spy")
    return spy


@contextlib.contextmanager
def sampling(pids: dict[str, int], out: Path, seconds: int) -> Iterator[dict[str, Path]]:
    spy = py_spy()
    files = {name: out / f"{name}.txt" for name in pids}
    procs = [
        subprocess.Popen(
            [
                spy,
                "record",
                "--pid",
                str(pid),
                "--format",
                "raw",
                "--rate",
                "100",
                "--nonblocking",
                "--gil",  # only the thread holding the GIL: Python on CPU, not waits
                "--duration",
                str(seconds),
                "--output",
                str(files[name]),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, pid in pids.items()
    ]
    try:
        yield files
    finally:
        for p in procs:
            p.wait(timeout=seconds + 60)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--rate", type=float, default=20.0, help="tokens/s per stream")
    parser.add_argument("--tokens", type=int, default=200, help="answer length (about)")
    parser.add_argument("--seconds", type=int, default=8, help="how long to sample")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--model-dir", type=Path, default=REPO / ".cache/models" / MODEL)
    args = parser.parse_args()
    raise_fd_limit(4 * args.streams + 1000)
    text = answer_text(args.model_dir, args.tokens)
    out = Path(tempfile.mkdtemp(prefix="lastevent-profile-"))
    with contextlib.ExitStack() as stack:
        url = os.environ.get("LASTEVENT_REDIS_URL") or stack.enter_context(local_redis())
        prefix = f"prof{uuid.uuid4().hex[:6]}"
        base, pids = stack.enter_context(lastevent(args.model_dir, args.rate, url, prefix, out, 10))
        before = commandstats(url)
        procs = {"worker": psutil.Process(pids[0]), "api": psutil.Process(pids[1])}
        times0 = {name: p.cpu_times() for name, p in procs.items()}
        with sampling({"worker": pids[0], "api": pids[1]}, out, args.seconds) as files:
            run = asyncio.run(drive(base, "lastevent", args.streams, text, drops=0, aborts=0))
            times1 = {name: p.cpu_times() for name, p in procs.items()}
        after = commandstats(url)
    print(
        f"\n{args.streams} streams x {args.rate:g} tok/s, ~{args.tokens} tokens: "
        f"{run.tokens} tokens in {run.wall_s:.1f} s; py-spy sampled the first {args.seconds} s"
    )
    k = max(run.tokens, 1) / 1000
    for name, t0 in times0.items():
        t1 = times1[name]
        print(
            f"{name}: CPU ms per 1,000 tokens: user {1000 * (t1.user - t0.user) / k:.0f}, "
            f"system {1000 * (t1.system - t0.system) / k:.0f} (the kernel: sockets, epoll)"
        )
    for name, path in files.items():
        samples, self_, total = top(path, args.top)
        print(f"\n{name}: {samples} samples on CPU")
        print("| self | total | function |")
        print("| --- | --- | --- |")
        totals = dict(total)
        for frame, k in self_:
            whole = 100 * totals.get(frame, k) / samples
            print(f"| {100 * k / samples:.1f}% | {whole:.1f}% | {frame} |")
        print("\nby total time:")
        for frame, k in total:
            print(f"  {100 * k / samples:5.1f}%  {frame}")
    print("\nRedis, per 1,000 delivered tokens (INFO commandstats):")
    print("| command | calls | CPU us |")
    print("| --- | --- | --- |")
    rows = []
    for cmd, (calls, usec) in after.items():
        c0, u0 = before.get(cmd, (0, 0))
        if usec - u0 > 0:
            rows.append((usec - u0, calls - c0, cmd))
    for usec, calls, cmd in sorted(rows, reverse=True)[: args.top]:
        print(f"| {cmd} | {calls / k:.1f} | {usec / k:.0f} |")
    print(f"\nraw stacks in {out}")


if __name__ == "__main__":
    main()
