"""Every failure of the store has one name: a connection Redis dropped under a command
is a ``ConnectionError`` (retried on a new connection), whatever the event loop says.

On uvloop, writing to a transport the peer closed raises ``RuntimeError: unable to
perform operation on <TCPTransport closed=True>``, not the OSError redis-py maps; a Redis
Cluster node that died mid-command did just that, and the error escaped every
store-error handler (a 500, an ``internal_error`` ending, a dead tail task).
"""

from __future__ import annotations

import asyncio

import pytest
import uvloop
from redis.exceptions import ConnectionError as RedisConnectionError

from service.store.pool import STORE_ERRORS, connect


def _closed_under_a_command(redis_url: str) -> tuple[str, object]:
    async def scenario() -> tuple[str, object]:
        client = connect(redis_url, max_connections=4)
        try:
            await client.ping()
            conn = await client.connection_pool.get_connection()
            conn._writer.transport.close()  # type: ignore[attr-defined]  # the peer is gone
            await asyncio.sleep(0.05)
            try:
                await conn.send_command("PING")
                await conn.read_response()
            except Exception as exc:  # noqa: BLE001 - what is raised is the point
                caught: object = exc
            else:
                caught = None
            await client.connection_pool.release(conn)
            # a command on the client goes through: a dead connection is replaced
            return str(await client.ping()), caught
        finally:
            await client.aclose()

    return uvloop.run(scenario())


def test_a_closed_transport_is_a_connection_error_on_uvloop(redis_url: str) -> None:
    answer, caught = _closed_under_a_command(redis_url)
    assert isinstance(caught, RedisConnectionError), repr(caught)
    assert isinstance(caught, STORE_ERRORS)
    assert answer == "True"


@pytest.mark.parametrize("message", ["something else broke"])
def test_other_runtime_errors_are_not_hidden(message: str) -> None:
    from service.store.pool import _lost

    assert not isinstance(_lost(RuntimeError(message)), RedisConnectionError)


def test_a_connection_closed_under_a_send_is_a_connection_error() -> None:
    """What the cluster client raised when it disconnected a node's connection (its slot
    map re-learnt in an election) while another task was connecting it (a 500 on a
    resume, seen in the chaos tier's election scenario)."""
    from service.store.pool import _lost

    gone = AttributeError("'NoneType' object has no attribute 'writelines'")
    assert isinstance(_lost(gone), RedisConnectionError)
    assert not isinstance(_lost(AttributeError("'Foo' has no attribute 'x'")), RedisConnectionError)
