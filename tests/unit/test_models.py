"""Many models: a request id carries its model's lane (which queues it waits in), the
heartbeat names what a worker serves, and a worker's adapters are read as vLLM's
``--lora-modules``."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.crc import key_slot

from service.api.request_ids import REQUEST_ID_RE, checked_request_id, new_request_id
from service.errors import NotFound
from service.settings import Settings
from service.store.heartbeats import Heartbeat
from service.store.keys import Keys, lane_of, model_lane
from service.store.registry import parse_lora_modules
from service.stream.events import Kind

names = st.text(min_size=1, max_size=80)


@given(model=names, other=names, kind=st.sampled_from(list(Kind)), partitions=st.integers(1, 32))
def test_a_request_id_names_its_models_queue(
    model: str, other: str, kind: Kind, partitions: int
) -> None:
    rid = new_request_id(kind, model)
    assert REQUEST_ID_RE.fullmatch(rid) and checked_request_id(rid) == rid
    assert lane_of(rid) == model_lane(model)
    keys = Keys("le", partitions)
    p = keys.partition(rid)
    assert keys.queue_of(rid) == keys.queue(p, model_lane(model))
    # in its partition's slot, whatever the model
    assert key_slot(keys.queue_of(rid).encode()) == key_slot(keys.meta(rid).encode())
    if model_lane(other) != model_lane(model):
        assert keys.queue_of(rid) != keys.queue(p, model_lane(other))


def test_ids_without_a_lane_wait_in_the_plain_queue() -> None:
    """An earlier version's ids (32 hex digits) and ids not made here."""
    old = "chatcmpl-" + "a" * 32
    assert REQUEST_ID_RE.fullmatch(old) and lane_of(old) == ""
    assert Keys("le").queue_of(old) == Keys("le").queue(0) == "le:{p0.0}:queue"
    assert lane_of("r1") == lane_of("chatcmpl-m123") == ""
    with pytest.raises(NotFound):
        checked_request_id("chatcmpl-m" + "a" * 31)  # a lane id one digit short


def test_lanes_are_the_same_in_every_process_and_apart() -> None:
    assert model_lane("SmolLM2-135M-Instruct") == "66939ff2"  # (ops/k8s names it)
    lanes = {model_lane(f"model-{i}") for i in range(2000)}
    assert len(lanes) == 2000 and all(len(x) == 8 for x in lanes)


@given(
    models=st.lists(names, max_size=4),
    running=st.frozensets(st.text(alphabet="abcdef0123456789-", min_size=1), max_size=5),
)
def test_a_heartbeat_round_trips_with_what_the_worker_serves(
    models: list[str], running: frozenset[str]
) -> None:
    beat = Heartbeat(8, 3, 1_700_000_000_000, 120, running, tuple(models))
    back = Heartbeat.decode(beat.encode())
    assert back == beat
    assert all(back.serves(m) for m in models) and not back.serves("\x00none")


def test_an_earlier_versions_heartbeat_serves_nothing() -> None:
    beat = Heartbeat.decode(b"8 3 1700000000000 120 r1,r2")
    assert (beat.slots, beat.busy, beat.running, beat.models) == (8, 3, {"r1", "r2"}, ())


def test_lora_modules_as_vllm_takes_them() -> None:
    assert parse_lora_modules("") == {}
    spec = " sql=/adapters/sql , tone=/a/b=c "
    assert parse_lora_modules(spec) == {"sql": "/adapters/sql", "tone": "/a/b=c"}
    for bad in ("sql", "=/x", "sql=", "a=/x,a=/y"):
        with pytest.raises(ValueError, match="LASTEVENT_LORA_MODULES"):
            parse_lora_modules(bad)


def test_the_api_accepts_its_model_then_lastevent_models(tmp_path: object) -> None:
    s = Settings(data_dir=tmp_path, models="b=/models/b, c")  # type: ignore[arg-type]
    dirs = s.model_dirs
    assert list(dirs) == [s.model_name, "b", "c"]
    assert str(dirs["b"]) == "/models/b" and dirs["c"] == s.data_dir / "models" / "c"
    assert Settings.from_env({"LASTEVENT_MODEL": "x"}).model_name == "x"
    assert (
        Settings.from_env({"LASTEVENT_MODEL": "x", "LASTEVENT_MODEL_NAME": "y"}).model_name == "y"
    )


def test_the_cpu_engine_refuses_adapters_at_the_start() -> None:
    from workers.__main__ import build_engine

    settings = Settings(engine="cpu", lora_modules="sql=/adapters/sql")
    with pytest.raises(SystemExit, match="cpu engine serves no LoRA adapters"):
        build_engine(settings, None)  # type: ignore[arg-type]
    with pytest.raises(SystemExit, match="is not name=path"):
        build_engine(Settings(engine="scripted", lora_modules="sql"), None)  # type: ignore[arg-type]
