"""Markdown tables and PNG plots from the harness's runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.clients import Run


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _fmt(value: float, unit: str) -> str:
    if value != value:  # nan
        return "n/a"
    return f"{value:.1f} {unit}".rstrip()


def _ratio(b: float, le: float) -> str:
    if not b or b != b or le != le:
        return ""
    return f"{le / b:.2f}"


def main_table(base: Run, le: Run, extra: dict[str, Any]) -> str:
    rows = [
        "| metric | baseline (no Redis) | lastevent | lastevent / baseline |",
        "| --- | --- | --- | --- |",
    ]

    def row(name: str, b: float, l_: float, unit: str) -> None:
        rows.append(f"| {name} | {_fmt(b, unit)} | {_fmt(l_, unit)} | {_ratio(b, l_)} |")

    row("delivered tokens/s", base.tokens_per_s, le.tokens_per_s, "tok/s")
    for q, name in ((0.5, "p50"), (0.99, "p99")):
        row(f"time to first token {name}", pct(base.ttft_ms, q), pct(le.ttft_ms, q), "ms")
    for q, name in ((0.5, "p50"), (0.99, "p99"), (1.0, "max")):
        row(f"added latency per token {name}", pct(base.added_ms, q), pct(le.added_ms, q), "ms")
    for q, name in ((0.5, "p50"), (0.99, "p99")):
        row(f"abort latency {name}", pct(base.abort_ms, q), pct(le.abort_ms, q), "ms")
    rows.append(
        f"| resume latency p50 / p99 | n/a (cannot resume) | "
        f"{pct(le.resume_ms, 0.5):.1f} / {pct(le.resume_ms, 0.99):.1f} ms | |"
    )
    rows.append(
        f"| lost / duplicated characters | {base.lost_chars} / {base.dup_chars} "
        f"({base.checked} streams) | {le.lost_chars} / {le.dup_chars} "
        f"({le.checked} streams) | |"
    )
    rows.append(f"| failed streams | {base.errors} | {le.errors} | |")
    for name, value in extra.items():
        rows.append(f"| {name} | n/a | {value} | |")
    return "\n".join(rows)


def sweep_table(runs: dict[int, tuple[Run, Run]], rate: float) -> str:
    rows = [
        "| streams | offered tok/s | baseline tok/s | lastevent tok/s | ratio | "
        "added p99 baseline / lastevent (ms) | TTFT p50 baseline / lastevent (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n, (b, le) in sorted(runs.items()):
        rows.append(
            f"| {n} | {n * rate:.0f} | {b.tokens_per_s:.0f} | {le.tokens_per_s:.0f} | "
            f"{_ratio(b.tokens_per_s, le.tokens_per_s)} | "
            f"{pct(b.added_ms, 0.99):.1f} / {pct(le.added_ms, 0.99):.1f} | "
            f"{pct(b.ttft_ms, 0.5):.0f} / {pct(le.ttft_ms, 0.5):.0f} |"
        )
    return "\n".join(rows)


def _none_if_nan(value: float) -> float | None:
    return None if value != value else value


def cpu_table(runs: dict[int, tuple[Run, Run]]) -> str:
    """CPU seconds per 1,000 delivered tokens, by process: where a 2-core machine goes."""
    rows = [
        "| streams | system | " + "CPU ms per 1,000 tokens: by process | total |",
        "| --- | --- | --- | --- |",
    ]
    for n, pair in sorted(runs.items()):
        for run in pair:
            k = max(run.tokens, 1) / 1000
            parts = ", ".join(f"{name} {sec / k * 1000:.0f}" for name, sec in run.cpu_s.items())
            total = sum(run.cpu_s.values()) / k * 1000
            rows.append(f"| {n} | {run.system} | {parts} | {total:.0f} |")
    return "\n".join(rows)


def summary_json(runs: dict[int, tuple[Run, Run]]) -> str:
    out = {}
    for n, pair in runs.items():
        for run in pair:
            out[f"{run.system}@{n}"] = {
                "tokens_per_s": run.tokens_per_s,
                "errors": run.errors,
                **{
                    f"{name}_p{int(q * 100)}": _none_if_nan(pct(getattr(run, name), q))
                    for name in ("ttft_ms", "added_ms", "resume_ms", "abort_ms")
                    for q in (0.5, 0.99, 1.0)
                },
            }
    return json.dumps(out, indent=1)


def plots(runs: dict[int, tuple[Run, Run]], rate: float, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = max(runs)
    base, le = runs[top]
    written = []

    def cdf(ax: Any, values: list[float], label: str) -> None:
        if not values:
            return
        xs = sorted(values)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.plot(xs, ys, label=f"{label} (n={len(xs)})")

    for name, attr, title in (
        ("added-latency-cdf.png", "added_ms", f"added latency per token, {top} streams"),
        ("ttft-cdf.png", "ttft_ms", f"time to first token, {top} streams"),
        ("abort-resume-cdf.png", None, f"abort and resume latency, {top} streams"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        if attr is None:
            cdf(ax, base.abort_ms, "baseline abort (disconnect)")
            cdf(ax, le.abort_ms, "lastevent abort (cancel)")
            cdf(ax, le.resume_ms, "lastevent resume")
        else:
            cdf(ax, getattr(base, attr), "baseline (no Redis)")
            cdf(ax, getattr(le, attr), "lastevent")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(out / name)

    fig, ax = plt.subplots(figsize=(6, 4))
    ns = sorted(runs)
    ax.plot(ns, [n * rate for n in ns], "k:", label="offered")
    ax.plot(ns, [runs[n][0].tokens_per_s for n in ns], "o-", label="baseline (no Redis)")
    ax.plot(ns, [runs[n][1].tokens_per_s for n in ns], "s-", label="lastevent")
    ax.set_xlabel(f"concurrent streams ({rate:g} tok/s each)")
    ax.set_ylabel("delivered tokens/s")
    ax.set_title("throughput vs concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=100)
    plt.close(fig)
    written.append(out / "throughput.png")
    return written
