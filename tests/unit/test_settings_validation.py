"""Settings are checked once, where they are built (``service/settings.py``): a choice
becomes its enum, a number is held to its bounds, and a bad value is one error that
names its ``LASTEVENT_*`` variable. Components trust what they are given."""

from __future__ import annotations

import dataclasses
import enum
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service import cli
from service.settings import (
    ABOVE_ZERO,
    AT_LEAST_ONE,
    AT_LEAST_ZERO,
    CHOICES,
    PREFIX,
    RANGES,
    Settings,
    SettingsError,
    SseFraming,
)
from service.stream import sse

FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
CHOICE_FIELDS = {name: CHOICES[str(f.type)] for name, f in FIELDS.items() if str(f.type) in CHOICES}
NUMBERS = {
    name
    for name, f in FIELDS.items()
    if str(f.type).split(" |")[0] in ("int", "float") and str(f.type) != "bool"
}
NEGATIVE_IS_A_CHOICE = {"worker_connection_grace_s", "park_after_s"}  # (-1: off)


def var(name: str) -> str:
    return PREFIX + name.upper()


def test_every_choice_is_an_enum() -> None:
    assert set(CHOICE_FIELDS) == {
        "sse_framing",
        "http",
        "event_loop",
        "auth",
        "durability",
        "tool_parser",
        "engine",
        "upstream_mode",
    }
    for name, choice in CHOICE_FIELDS.items():
        assert isinstance(getattr(Settings(), name), choice)


@pytest.mark.parametrize("name", sorted(CHOICE_FIELDS))
def test_a_bad_choice_names_its_variable_and_the_choices(name: str) -> None:
    with pytest.raises(SettingsError) as raised:
        Settings.from_env({var(name): "bogus"})
    message = str(raised.value)
    assert message.startswith(f"{var(name)}='bogus': one of ")
    assert all(member.value in message for member in CHOICE_FIELDS[name])
    assert "\n" not in message
    with pytest.raises(SettingsError, match=var(name)):  # built in code: the same check
        Settings(**{name: "bogus"})


@st.composite
def choices(draw: st.DrawFn) -> tuple[str, enum.StrEnum]:
    name = draw(st.sampled_from(sorted(CHOICE_FIELDS)))
    return name, draw(st.sampled_from(list(CHOICE_FIELDS[name])))


@given(choices())
def test_any_valid_choice_round_trips(picked: tuple[str, enum.StrEnum]) -> None:
    name, member = picked
    built = Settings.from_env({var(name): member.value})
    assert getattr(built, name) is member
    assert built.to_env()[var(name)] == member.value
    assert getattr(Settings.from_env(built.to_env()), name) is member
    assert getattr(Settings(**{name: member.value}), name) is member  # a string in code
    assert getattr(dataclasses.replace(Settings(), **{name: member}), name) is member


def test_every_number_has_its_bounds_and_every_bound_a_number() -> None:
    tables = [ABOVE_ZERO, AT_LEAST_ZERO, AT_LEAST_ONE]
    for table in [*tables, set(RANGES)]:
        assert table <= NUMBERS, f"not a numeric setting: {sorted(table - NUMBERS)}"
    for name in NUMBERS:
        held = sum(name in table for table in tables) + (name in RANGES)
        assert held or name in NEGATIVE_IS_A_CHOICE, f"{var(name)} has no bound"
        assert sum(name in table for table in tables) <= 1, f"{var(name)}: two least values"


@pytest.mark.parametrize(
    ("name", "raw", "why"),
    [
        ("tail_count", "0", "must be 1 or more"),
        ("worker_concurrency", "-3", "must be 1 or more"),
        ("redis_silent_s", "0", "must be more than 0"),
        ("redis_silent_s", "nan", "not a number"),
        ("commit_timeout_ms", "-1", "must be more than 0"),
        ("max_takeovers", "-1", "must be 0 or more"),
        ("resume_window_s", "-5", "must be 0 or more"),
        ("port", "70000", "must be from 0 to 65535"),
        ("vllm_gpu_memory_utilization", "1.5", "must be from 0 to 1"),
        ("vllm_gpu_memory_utilization", "0", "must be more than 0"),
        ("park_after_s", "nan", "not a number"),
    ],
)
def test_an_out_of_bound_number_names_its_variable(name: str, raw: str, why: str) -> None:
    with pytest.raises(SettingsError) as raised:
        Settings.from_env({var(name): raw})
    assert str(raised.value).startswith(f"{var(name)}=")
    assert why in str(raised.value)


def test_a_number_that_is_no_number_names_its_variable() -> None:
    with pytest.raises(SettingsError, match=r"^LASTEVENT_TAIL_COUNT='many': "):
        Settings.from_env({"LASTEVENT_TAIL_COUNT": "many"})


@given(st.sampled_from(sorted(NUMBERS)), st.integers(1, 65535))
def test_numbers_within_bounds_are_kept(name: str, value: int) -> None:
    if name == "vllm_gpu_memory_utilization":
        value = 1
    built = Settings.from_env({var(name): str(value)})
    assert getattr(built, name) == value


@pytest.mark.parametrize("name", sorted(NEGATIVE_IS_A_CHOICE))
def test_a_negative_value_is_a_choice_for_some(name: str) -> None:
    assert getattr(Settings.from_env({var(name): "-1"}), name) == -1
    assert not math.isnan(getattr(Settings(), name))


def test_the_framings_are_the_streams_own() -> None:
    assert {f.value for f in SseFraming} == set(sse.FRAMINGS)


def test_the_command_says_one_line_not_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LASTEVENT_DURABILITY", "bogus")
    with pytest.raises(SystemExit) as raised:
        cli.main(["up"])
    assert raised.value.code == (
        "lastevent: LASTEVENT_DURABILITY='bogus': one of memory, disk, replica"
    )
