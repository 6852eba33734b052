"""``lastevent worker``: one engine, one process. SIGTERM/SIGINT drain, then exit.
``lastevent recorder``: a recorder on its own. Each serves its metrics on
``LASTEVENT_METRICS_PORT``."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
from collections.abc import Callable

from redis.asyncio import Redis

from service import aio
from service.ledger.ledger import Ledger, make_engine
from service.settings import Settings, UpstreamMode
from service.store import commit, pool
from service.store.commit import Committer
from service.store.keys import Keys
from service.store.local import LocalFeed
from service.store.log import RedisLog
from service.store.outbox import Outbox
from service.store.pool import warm
from service.store.registry import parse_lora_modules
from service.tokenize import ModelInfo
from workers.engines.base import Engine
from workers.metrics import serve_metrics
from workers.recorder import Recorder
from workers.runner import Runner

log = logging.getLogger("lastevent.worker")


def build_engine(settings: Settings, model: ModelInfo) -> Engine:
    try:
        adapters = parse_lora_modules(settings.lora_modules)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if settings.engine == "scripted":
        from workers.engines.scripted import ScriptedEngine

        return ScriptedEngine(
            model,
            tokens_per_s=settings.scripted_tokens_per_s,
            text=settings.scripted_text,
            fail_after=settings.scripted_fail_after,
            stall_after=settings.scripted_stall_after,
            prefill_s=settings.scripted_prefill_s,
            crash_after=settings.scripted_crash_after,
            adapters=list(adapters),
        )
    if settings.engine == "cpu":
        if adapters:
            raise SystemExit(
                "the cpu engine serves no LoRA adapters: unset LASTEVENT_LORA_MODULES, or "
                "run them on the vllm engine (a model of its own: another worker)"
            )
        from workers.engines.cpu import CpuEngine

        return CpuEngine(
            settings.resolved_model_dir,
            eos_token_ids=model.eos_token_ids,
            max_batch=settings.cpu_max_batch,
            prefill_chunk=settings.cpu_prefill_chunk,
            grammar_timeout_s=settings.grammar_compile_timeout_s,
        )
    if settings.engine == "vllm":
        from workers.engines.vllm import VllmConfig, VllmEngine

        return VllmEngine(
            VllmConfig(
                model_dir=settings.resolved_model_dir,
                eos_token_ids=model.eos_token_ids,
                dtype=settings.vllm_dtype,
                max_model_len=settings.vllm_max_model_len,
                tensor_parallel_size=settings.vllm_tensor_parallel_size,
                gpu_memory_utilization=settings.vllm_gpu_memory_utilization,
                kv_cache_gb=settings.vllm_kv_cache_gb,
                enforce_eager=settings.vllm_enforce_eager,
                adapters=tuple(adapters.items()),
            )
        )
    return _upstream(settings, model, adapters)  # (Engine.UPSTREAM: Settings checked it)


def _upstream(settings: Settings, model: ModelInfo, adapters: dict[str, str]) -> Engine:
    from workers.engines.upstream import UpstreamConfig, UpstreamEngine
    from workers.engines.upstream_text import TextUpstreamEngine

    try:
        urls = UpstreamConfig.parse_urls(settings.upstream_url)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    config = UpstreamConfig(
        urls=urls,
        model=settings.upstream_model or settings.model_name,
        api_key=settings.upstream_api_key,
        eos_token_ids=model.eos_token_ids,
        idle_timeout_s=settings.upstream_idle_timeout_s,
        first_token_timeout_s=settings.upstream_first_token_timeout_s,
        retry_s=settings.upstream_retry_s,
    )
    if adapters:  # (their names are the upstream's: it serves them)
        raise SystemExit(
            "LASTEVENT_LORA_MODULES is for in-process engines; an upstream's adapters are "
            "models of their own: one worker each (LASTEVENT_UPSTREAM_MODEL)"
        )
    return (
        TextUpstreamEngine(config)
        if settings.upstream_mode is UpstreamMode.TEXT
        else UpstreamEngine(config)
    )


def build_recorder(
    settings: Settings, redis: Redis, ledger: Ledger, committer: Committer | None = None
) -> Recorder:
    keys = Keys(settings.key_prefix, settings.partitions)
    committer = committer or commit.of(settings, redis, keys)
    return Recorder(
        Outbox(redis, keys, committer),
        RedisLog(redis, keys, committer=committer),
        ledger,
        consumer=settings.worker_id,
        claim_idle_ms=settings.recorder_claim_idle_ms,
        retention_s=settings.outbox_retention_s,
        crash_after_insert=settings.recorder_crash_after_insert,
    )


async def serve(
    settings: Settings,
    feed: LocalFeed | None = None,
    held_by: Callable[[Runner], None] | None = None,
) -> None:
    """The worker until it is stopped. In a node (``service/cli/node.py``): ``feed``
    hands its appends to the readers in the process, and ``held_by`` gets the runner
    instead of the signals (the node stops it), and the HTTP server serves the metrics."""
    if settings.engine == "cpu" and settings.cpu_max_batch < settings.worker_concurrency:
        # the CPU engine's slots are its batch: the worker claims no more (the rest wait
        # in the queue, where admission counts them and another worker may take them)
        settings = dataclasses.replace(settings, worker_concurrency=max(1, settings.cpu_max_batch))
    if not settings.redis_url:
        raise SystemExit("LASTEVENT_REDIS_URL is not set")
    if held_by is None:
        serve_metrics(settings.metrics_port, settings.host)
    model = ModelInfo.load(settings.resolved_model_dir, settings.model_name)
    engine = build_engine(settings, model)
    redis = pool.of(settings, 64)
    await warm(redis)
    runner = Runner(settings, redis, engine, model, feed)
    # (before minutes of engine load)
    await commit.started(runner.log.committer, "worker", settings.startup_replica_wait_s)
    await engine.start()
    db = make_engine(settings.database_url) if settings.database_url else None
    recorder = None
    if db is not None and settings.recorder_in_worker:
        recorder = build_recorder(settings, redis, Ledger(db), runner.log.committer)
    if held_by is None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, runner.stop)
        aio.dump_tasks_on_sigusr1()
    else:
        held_by(runner)
    aio.freeze_heap()
    log.info("worker %s ready (engine %s)", settings.worker_id, engine.name)
    recording = asyncio.create_task(recorder.run()) if recorder else None
    try:
        await runner.run()
    finally:
        if recording is not None and recorder is not None:
            await asyncio.sleep(0.5)  # let the last terminal events reach Postgres
            recorder.stop()
            await _within("the recorder", recording)
        await _within("the engine's close", asyncio.ensure_future(engine.close()))
        await _within("the Redis pool's close", asyncio.ensure_future(redis.aclose()))
        if db is not None:
            await _within("the Postgres pool's close", asyncio.ensure_future(db.dispose()))
        if held_by is None:  # (a node's HTTP server is still closing its own)
            await _leave_nothing_running()


async def _within(what: str, task: asyncio.Future[None], timeout_s: float = 5.0) -> None:
    """Wait for ``task`` a bounded time, then cancel it: a stopping worker always exits."""
    _, pending = await asyncio.wait({task}, timeout=timeout_s)
    if pending:
        log.warning("%s did not finish within %g s; cancelled", what, timeout_s)
        task.cancel()
        await asyncio.wait({task}, timeout=timeout_s)


async def _leave_nothing_running(timeout_s: float = 5.0) -> None:
    """Cancel what is left; a task that will not stop is logged and the process exits
    anyway (everything a worker holds is in Redis: its requests were ended or handed
    over, and whatever it still held is taken over when its heartbeat goes stale)."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    for task in others:
        task.cancel()
    if others:
        _, stuck = await asyncio.wait(others, timeout=timeout_s)
        if stuck:
            log.error("%d task(s) would not stop; exiting anyway", len(stuck))
            aio.dump_tasks()
            logging.shutdown()
            os._exit(0)


async def serve_recorder(settings: Settings) -> None:
    if not settings.redis_url or not settings.database_url:
        raise SystemExit("LASTEVENT_REDIS_URL and LASTEVENT_DATABASE_URL must be set")
    serve_metrics(settings.metrics_port, settings.host)
    redis = pool.of(settings, 8)
    await warm(redis)
    db = make_engine(settings.database_url)
    recorder = build_recorder(settings, redis, Ledger(db))
    await commit.started(recorder.outbox.committer, "recorder", settings.startup_replica_wait_s)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, recorder.stop)
    log.info("recorder %s ready", settings.worker_id)
    try:
        await recorder.run()
    finally:
        await redis.aclose()
        await db.dispose()


def main(settings: Settings | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # (a line per upstream call)
    settings = settings or Settings.from_env()
    aio.run(serve(settings), settings.event_loop)


def main_recorder(settings: Settings | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    settings = settings or Settings.from_env()
    aio.run(serve_recorder(settings), settings.event_loop)


if __name__ == "__main__":
    main()
