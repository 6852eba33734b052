"""Schemathesis against the project's own OpenAPI schema: no 5xx, responses conform."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.e2e.conftest import Stack, running

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def fuzz_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    with running(
        tmp_path_factory.mktemp("schema"),
        redis_url,
        database_url,
        model_dir,
        scripted_tokens_per_s=0.0,
        worker_concurrency=64,
        default_max_tokens=4,
        operator_token="fuzz-operator",
    ) as st:
        yield st


@pytest.fixture(scope="module")
def api_schema(fuzz_stack: Stack):  # type: ignore[no-untyped-def]
    return schemathesis.openapi.from_url(fuzz_stack.url + "/schema/openapi.json")


# No 5xx, and every response (status, headers, body) as the schema documents it. Not
# "positive data acceptance": the schema types the fields, the server also checks
# values against the model (its name, context length), which the schema cannot say.
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def test_no_server_errors_and_conforming_responses(api_schema) -> None:  # type: ignore[no-untyped-def]
    """Every operation, a bounded number of generated requests each (schemathesis' own
    pytest plugin does not load under this pytest, so its strategies are driven here)."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 8
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        def check(case) -> None:  # type: ignore[no-untyped-def]
            case.call_and_validate(timeout=30, checks=CHECKS)

        check()
