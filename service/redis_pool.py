"""Redis clients whose pools wait for a free connection instead of failing.

redis-py's default asyncio pool raises ``MaxConnectionsError`` the moment every
connection is busy. Under a burst (a worker claiming 64 jobs at once, 500 clients
connecting to one API process) that turned into failed requests. A blocking pool
queues the caller until a connection is free, for at most ``wait_s``.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis


def connect(url: str, max_connections: int, *, wait_s: float = 30.0, **kwargs: Any) -> Redis:
    pool = BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=wait_s, **kwargs
    )
    return Redis.from_pool(pool)
