"""A lastevent client whose token streams survive broken connections.

    from lastevent_client import Client

    with Client("http://127.0.0.1:8000", api_key="sk-...") as client:
        stream = client.chat.stream(model="m", messages=[{"role": "user", "content": "hi"}])
        for text in stream:
            print(text, end="", flush=True)

See README.md for the protocol (Idempotency-Key, Last-Event-ID, X-Stream-Token, 204).
"""

from lastevent_client._client import AsyncClient, AsyncStream, Client, Stream
from lastevent_client._core import Backoff, LastEventError

__all__ = ["AsyncClient", "AsyncStream", "Backoff", "Client", "LastEventError", "Stream"]
__version__ = "0.1.0"
