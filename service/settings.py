"""Settings, read once from ``LASTEVENT_*`` environment variables and passed in.

Nothing in the project reads the environment at import time: ``Settings.from_env()``
is called by the CLI (or a test) and the result is handed to the app and the worker.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import socket
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import platformdirs

PREFIX = "LASTEVENT_"
MODEL_NAME = "SmolLM2-135M-Instruct"


class SettingsError(ValueError):
    """A ``LASTEVENT_*`` variable's value that cannot be used: one line naming it."""


# the settings that are choices: each value is one member's (``LASTEVENT_X=value``)
class Durability(enum.StrEnum):  # what a reader may be sent (service/store/commit.py)
    MEMORY = "memory"  # whatever Redis answered
    DISK = "disk"  # fsynced in the primary's AOF
    REPLICA = "replica"  # a replica has it too


class SseFraming(enum.StrEnum):  # service/stream/sse.py
    RESUMABLE = "resumable"  # id: and retry: lines
    OPENAI = "openai"  # data: lines only, event_id in each chunk's JSON


class Http(enum.StrEnum):
    HTTPTOOLS = "httptools"  # C
    H11 = "h11"  # pure Python


class EventLoop(enum.StrEnum):
    UVLOOP = "uvloop"  # libuv
    ASYNCIO = "asyncio"


class Auth(enum.StrEnum):
    REQUIRED = "required"
    OFF = "off"  # requests without a key act as tenant "default"


class ToolParser(enum.StrEnum):
    AUTO = "auto"  # from the model's chat template
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"


class Engine(enum.StrEnum):
    CPU = "cpu"
    SCRIPTED = "scripted"
    VLLM = "vllm"
    UPSTREAM = "upstream"


class UpstreamMode(enum.StrEnum):
    TOKENS = "tokens"  # vLLM's server: exact
    TEXT = "text"  # any OpenAI-compatible server


def default_data_dir() -> Path:
    return Path(platformdirs.user_data_dir("lastevent", appauthor=False))


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    # where things are
    redis_url: str | None = None  # None: `lastevent up` starts an embedded Valkey
    database_url: str | None = None  # None: `lastevent up` starts an embedded Postgres
    data_dir: Path = dataclasses.field(default_factory=default_data_dir)
    model_dir: Path | None = None  # default: <data_dir>/models/<model_name>
    model_name: str = MODEL_NAME  # (also read as LASTEVENT_MODEL) the model served
    # a worker's LoRA adapters on its model, as vLLM's --lora-modules: "name=path,..."
    lora_modules: str = ""
    # more models the API accepts (and `lastevent up` starts a worker for): "name=dir,..."
    # (a name alone: <data_dir>/models/<name>); each needs its tokenizer in that dir
    models: str = ""
    key_prefix: str = "le"  # every Redis key starts with it (tests use random ones)
    redis_cluster: bool = False  # LASTEVENT_REDIS_URL names nodes of a Redis Cluster
    # (a cluster's URL may list several seed nodes: "redis://a:6379,redis://b:6379")
    # a Redis node that answers nothing for this long past a command's own wait (frozen,
    # partitioned: its sockets open, no reply) is given up, and the slot map learnt again
    # (service/store/pool.py); keep it under the cluster's node timeout
    redis_silent_s: float = 2.0
    # requests are spread over this many partitions, one cluster slot each (the same in
    # every process; changed only with no request in flight): keys.py
    partitions: int = 1

    # API
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 1_000_000
    # images (chat image_url, Responses input_image) for a model whose worker sees them:
    # at most this many per request, each at most this many bytes decoded (a data URL is
    # also bounded by max_body_bytes); remote http(s) URLs fetched by the API only when
    # image_fetch is on (off: a 400), each within image_fetch_timeout_s
    max_images: int = 8
    image_max_bytes: int = 4_000_000
    image_max_pixels: int = 33_177_600  # width x height (7680x4320), as its header says
    image_fetch: bool = False
    image_fetch_timeout_s: float = 10.0
    drain_s: float = 10.0  # on SIGTERM: streams are told to reconnect; exit within this
    reconnect_hint_ms: int = 1000  # the SSE `retry:` sent to streams when draining
    # streams' framing unless a request asks (X-SSE-Framing / ?sse_framing=)
    sse_framing: SseFraming = SseFraming.RESUMABLE
    send_timeout_s: float = 30.0  # a client that accepts no bytes this long is cut off
    request_read_timeout_s: float = 10.0  # the whole request (head + body) must arrive in this
    http: Http = Http.HTTPTOOLS  # the HTTP/1.1 implementation
    event_loop: EventLoop = EventLoop.UVLOOP  # every process's asyncio loop
    operator_token: str | None = None  # break-glass Bearer token for /v1/admin (None: off)
    auth: Auth = Auth.REQUIRED
    auth_cache_s: float = 30.0  # verified keys are cached this long (revocation delay)
    cors_origins: str = ""  # comma-separated origins allowed cross-origin ("*": any)
    stream_token_secret: str | None = None  # None: one made at random, shared via Redis
    stream_token_ttl_s: float = 3600.0  # how long a stream token reads its request
    idempotency_ttl_s: int = 86400  # an Idempotency-Key names the same request this long
    # the keys `lastevent up` makes for local use (service/cli/local_keys.py): "random"
    # (made once, kept in the data dir, printed at every start), "" (none), or a key
    # sk-le-<id>-<secret> (refused when `up` listens beyond loopback or uses outside servers)
    dev_api_key: str = "random"  # tenant dev
    dev_operator_key: str = "random"  # tenant ops (the console's)
    # the Host names the API answers (DNS rebinding): "api.example.com,*.example.org"; "*":
    # any; "[ip]": any IP address. Empty: any, but loopback names and IP addresses under
    # `lastevent up` (service/api/gate.py)
    allowed_hosts: str = ""
    # proxies whose X-Forwarded-For names the client (uvicorn's forwarded_allow_ips):
    # "10.0.0.0/8,127.0.0.1"; empty: none (the client is the connection's peer)
    trusted_proxies: str = ""
    # failed API keys / stream tokens one client address may send per minute, then 429
    # until the minute has passed, without asking Postgres (0: unlimited)
    auth_failures_per_minute: int = 30
    # open readers (streams) of one request, and of one API key, per API process (0:
    # unlimited); beyond them a reader gets 429 with Retry-After
    max_readers_per_request: int = 16
    max_readers_per_key: int = 1000
    default_max_tokens: int = 256
    max_model_len: int = 8192

    # admission (429 / 503)
    rate_limit_rpm: int = 0  # requests per minute per API key (0: unlimited)
    max_concurrent_per_key: int = 0  # requests in flight per API key (0: unlimited)
    max_queue_wait_s: float = 30.0  # 503 when the queue would wait longer than this
    max_streams: int = 10_000  # open readers per API process before 503
    worker_stale_s: float = 5.0  # a worker without a heartbeat this long is lost
    sweep_interval_s: float = 2.0  # how often each API process looks for lost workers' jobs
    worker_heartbeat_s: float = 1.0  # how often a worker says it is alive (< worker_stale_s)
    # a worker whose named connection has been gone this long is lost at once (its process
    # died: the kernel closed its socket); negative: the heartbeat alone (store/liveness.py)
    worker_connection_grace_s: float = 0.2
    worker_connection_poll_s: float = 0.1  # how often each API process looks (one call)

    # event log
    # what a reader may be sent (service/store/commit.py)
    durability: Durability = Durability.DISK
    commit_timeout_ms: int = 1000  # a commit barrier not confirmed in this long: 503 / retry
    # at replica, a primary without a replica when a process starts: asked again this long
    # (a failover under way) before the process refuses to start
    startup_replica_wait_s: float = 30.0
    hot_log_ttl_s: int = 3600  # the log stays in Redis this long after its terminal event
    unstored_ttl_s: int = 30  # ... and this long for a ``store: false`` response (readers
    # between connections can still finish reading it)
    tail_block_ms: int = 5000  # the multiplexed XREAD BLOCK timeout
    tail_count: int = 512  # XREAD COUNT per stream per call
    tail_shard_size: int = 1000  # logs per multiplexed XREAD (one Redis connection each)
    keepalive_s: float = 15.0  # `: ping` comment after this long without an event
    coalesce_backlog: int = 4  # a reader this many batches behind gets deltas merged

    # presence, parking, abandonment, cancel
    # a request whose last reader left may be resumed this long (its resume window; per
    # request: stream_options.resume_grace_s); None: as long as a finished log stays hot
    resume_window_s: float | None = None
    # no reader this long (and a window longer than it): the request leaves the engine,
    # parked, and goes on when a reader comes back (-1: never park)
    park_after_s: float = 1.5
    # how the model writes tool calls
    tool_parser: ToolParser = ToolParser.AUTO
    max_resume_grace_s: float = 3600.0  # the largest per-request grace a client may ask for
    lease_ttl_s: float = 10.0  # a reader's lease lapses this long after its last refresh
    lease_refresh_s: float = 3.0  # how often an API process refreshes its readers' leases
    presence_check_s: float = 0.5  # how often a worker checks its requests' readers and cancels
    cancel_wait_s: float = 5.0  # POST .../cancel waits this long for the terminal event

    # worker
    engine: Engine = Engine.CPU
    worker_id: str = dataclasses.field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    )
    worker_concurrency: int = 8  # requests one worker runs at once
    # the CPU engine: requests decoded together (1: one at a time, as before batching),
    # and the prompt tokens a joining request prefills per step (its wait for the others)
    cpu_max_batch: int = 8
    cpu_prefill_chunk: int = 256
    # a structured request whose grammar (JSON schema) takes longer to compile ends in error
    grammar_compile_timeout_s: float = 10.0
    worker_drain_s: float = 30.0  # on SIGTERM: running requests may finish this long, then
    # the rest are handed over to another worker
    max_takeovers: int = 2  # times a request's worker may be lost and another continue it
    takeover_wait_s: float = 0.0  # how long a lost worker's request waits for another (0:
    # until its deadline); then it ends errored worker_lost
    request_deadline_s: float = 600.0
    # a worker's appends go to Redis at most this often (ms): under load each flush carries
    # this long's engine steps of all its requests, each token waits up to this long more
    flush_interval_ms: float = 5.0
    # Prometheus /metrics of a worker or recorder process, on LASTEVENT_HOST (0: none); a
    # worker's in-process recorder shares the worker's (the API's: GET /metrics, its port)
    metrics_port: int = 9464

    # vLLM engine (LASTEVENT_ENGINE=vllm); one worker process per engine
    vllm_dtype: str = "auto"  # float32 on CPU; bfloat16 / float16 on GPU
    vllm_max_model_len: int | None = None  # None: the model's own
    vllm_tensor_parallel_size: int = 1  # GPUs one engine spans
    vllm_gpu_memory_utilization: float = 0.9
    vllm_kv_cache_gb: float | None = None  # CPU build only (VLLM_CPU_KVCACHE_SPACE)
    vllm_enforce_eager: bool = False  # True on CPU: torch.compile takes minutes there

    # upstream engine (LASTEVENT_ENGINE=upstream): an OpenAI-compatible server does the work
    upstream_url: str = ""  # its base URL, ending in /v1 (several, comma-separated: replicas)
    upstream_api_key: str | None = None
    upstream_model: str | None = None  # the name it serves (None: LASTEVENT_MODEL_NAME)
    upstream_mode: UpstreamMode = UpstreamMode.TOKENS
    upstream_idle_timeout_s: float = 30.0  # its stream, once it spoke, silent this long: hung
    upstream_first_token_timeout_s: float = 600.0  # ... or silent from the start this long
    upstream_retry_s: float = 30.0  # a request tries a failing upstream again this long

    # recorder (outbox -> Postgres rows + archived logs)
    recorder_in_worker: bool = True  # each worker also runs a recorder
    recorder_claim_idle_ms: int = 30_000  # take over another recorder's entries after this
    outbox_retention_s: int = 7 * 86400  # outbox entries (what reconcile checks) kept this long
    archive_retention_days: int = 90  # `lastevent archive purge` default
    # keep every request's input (messages, tools, parameters) in its log and archive for
    # audit, whatever ``store`` says (a tenant can be set so too: `lastevent tenants`)
    keep_inputs: bool = False
    recorder_crash_after_insert: bool = False  # fault injection (tests): exit before the ack

    # scripted engine (tests and benchmarks)
    scripted_tokens_per_s: float = 50.0
    scripted_text: str | None = None  # None: echo the last user message
    scripted_fail_after: int | None = None  # raise after this many tokens
    scripted_crash_after: int | None = None  # raise a non-engine error (a bug) after this many
    scripted_stall_after: int | None = None  # stop producing after this many tokens
    scripted_prefill_s: float = 0.0  # a prefill this long before the first token

    def __post_init__(self) -> None:
        """Each choice made its enum, each number checked: components trust what they get."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            choice = CHOICES.get(str(field.type))
            if choice is not None:
                object.__setattr__(self, field.name, _choice(choice, field.name, value))
            elif isinstance(value, int | float):  # (a bool too: no bound of its own)
                _check_bounds(field.name, value)

    @property
    def resume_window(self) -> float:
        return self.hot_log_ttl_s if self.resume_window_s is None else self.resume_window_s

    @property
    def resolved_model_dir(self) -> Path:
        return self.model_dir or self.data_dir / "models" / self.model_name

    @property
    def model_dirs(self) -> dict[str, Path]:
        """Every model the API accepts, with its directory: the model, then ``models``."""
        out = {self.model_name: self.resolved_model_dir}
        for part in (p.strip() for p in self.models.split(",")):
            if part:
                name, sep, path = part.partition("=")
                out[name.strip()] = (
                    Path(path.strip()).expanduser() if sep else self.data_dir / "models" / name
                )
        return out

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        env = os.environ if env is None else env
        env = {
            **{
                PREFIX + new: env[PREFIX + old]
                for old, new in ALIASES.items()
                if PREFIX + old in env
            },
            **env,
        }
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            raw = env.get(PREFIX + field.name.upper())
            if raw is None or (raw == "" and field.name not in EMPTY_MEANS_NONE):
                continue
            values[field.name] = _convert(field.type, raw, field.name)
        values.update(overrides)
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """The environment that reproduces these settings in a child process."""
        out: dict[str, str] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            out[PREFIX + field.name.upper()] = str(value)
        return out


# settings where an empty value is a choice ("none"), not "the default"
EMPTY_MEANS_NONE = frozenset({"dev_api_key", "dev_operator_key"})

# former names, still read (the new name wins when both are set)
ALIASES = {"RESUME_GRACE_S": "RESUME_WINDOW_S", "MODEL": "MODEL_NAME"}


CHOICES: dict[str, type[enum.StrEnum]] = {
    e.__name__: e
    for e in (Durability, SseFraming, Http, EventLoop, Auth, ToolParser, Engine, UpstreamMode)
}


def _names(*lines: str) -> frozenset[str]:
    return frozenset(" ".join(lines).split())


# each number's least value: above zero, zero, or one (a count); the rest take a negative
# value as a choice (off). A range is checked beside.
ABOVE_ZERO = _names(
    "redis_silent_s max_body_bytes image_max_bytes image_max_pixels image_fetch_timeout_s",
    "send_timeout_s request_read_timeout_s stream_token_ttl_s idempotency_ttl_s",
    "worker_stale_s sweep_interval_s worker_heartbeat_s worker_connection_poll_s",
    "commit_timeout_ms hot_log_ttl_s unstored_ttl_s tail_block_ms keepalive_s lease_ttl_s",
    "lease_refresh_s presence_check_s grammar_compile_timeout_s request_deadline_s",
    "vllm_kv_cache_gb upstream_idle_timeout_s upstream_first_token_timeout_s",
    "recorder_claim_idle_ms outbox_retention_s vllm_gpu_memory_utilization",
)
AT_LEAST_ZERO = _names(
    "max_images drain_s reconnect_hint_ms auth_cache_s auth_failures_per_minute",
    "max_readers_per_request max_readers_per_key rate_limit_rpm max_concurrent_per_key",
    "max_queue_wait_s startup_replica_wait_s coalesce_backlog resume_window_s",
    "max_resume_grace_s cancel_wait_s worker_drain_s max_takeovers takeover_wait_s",
    "flush_interval_ms upstream_retry_s archive_retention_days scripted_tokens_per_s",
    "scripted_fail_after scripted_crash_after scripted_stall_after scripted_prefill_s",
)
AT_LEAST_ONE = _names(
    "partitions default_max_tokens max_model_len max_streams tail_count tail_shard_size",
    "worker_concurrency cpu_max_batch cpu_prefill_chunk vllm_max_model_len",
    "vllm_tensor_parallel_size",
)
PORT = (0.0, 65535.0)
RANGES = {"port": PORT, "metrics_port": PORT, "vllm_gpu_memory_utilization": (0.0, 1.0)}


def _choice(choice: type[enum.StrEnum], name: str, value: object) -> enum.StrEnum:
    try:
        return choice(str(value))
    except ValueError:
        allowed = ", ".join(member.value for member in choice)
        raise SettingsError(f"{PREFIX}{name.upper()}={value!r}: one of {allowed}") from None


def _check_bounds(name: str, value: float) -> None:
    what = f"{PREFIX}{name.upper()}={value!r}"
    if math.isnan(value):
        raise SettingsError(f"{what}: not a number")
    if name in ABOVE_ZERO and not value > 0:
        raise SettingsError(f"{what}: must be more than 0")
    if name in AT_LEAST_ZERO and not value >= 0:
        raise SettingsError(f"{what}: must be 0 or more")
    if name in AT_LEAST_ONE and not value >= 1:
        raise SettingsError(f"{what}: must be 1 or more")
    low, high = RANGES.get(name, (-math.inf, math.inf))
    if not low <= value <= high:
        raise SettingsError(f"{what}: must be from {low:g} to {high:g}")


def _convert(type_name: Any, raw: str, name: str) -> Any:
    t = str(type_name)
    try:
        if "Path" in t:
            return Path(raw).expanduser()
        if t.startswith("int"):
            return int(raw)
        if t.startswith("float"):
            return float(raw)
        if t.startswith("bool"):
            return raw.lower() in ("1", "true", "yes", "on")
        if "int |" in t:
            return int(raw)
    except ValueError as exc:
        raise SettingsError(f"{PREFIX}{name.upper()}={raw!r}: {exc}") from None
    return raw
