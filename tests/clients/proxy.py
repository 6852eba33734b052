"""A TCP proxy that cuts connections: what a phone on a flaky network does to a stream.

Every connection it accepts is forwarded to ``target``; once the server has sent it
``cut`` bytes (drawn anew per connection between ``min_bytes`` and ``max_bytes``), both
sides are closed, mid-event if it falls there. ``cuts`` counts the connections it cut.
Run it on its own for a browser or a Node client:

    python -m tests.clients.proxy --target 127.0.0.1:8000 --port 9000 --min 300 --max 3000
"""

from __future__ import annotations

import argparse
import asyncio
import random
import threading


class CuttingProxy:
    def __init__(
        self,
        target: tuple[str, int],
        *,
        min_bytes: int = 300,
        max_bytes: int = 3000,
        seed: int | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.target = target
        self.min_bytes, self.max_bytes = min_bytes, max_bytes
        self.cutting = True  # False: a plain proxy
        self.cuts = 0
        self.connections = 0
        self._random = random.Random(seed)
        self._host, self._port = host, port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._server: asyncio.base_events.Server | None = None

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}"

    def start(self) -> CuttingProxy:
        """Serve in a thread of its own (for synchronous tests)."""
        threading.Thread(target=self._run, daemon=True).start()
        self._ready.wait(10)
        return self

    def close(self) -> None:
        if self._loop is not None and self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self.serve())
        self._ready.set()
        self._loop.run_forever()

    async def serve(self) -> None:
        self._server = await asyncio.start_server(self._handle, self._host, self._port)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        budget = self._random.randint(self.min_bytes, self.max_bytes) if self.cutting else None
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        upload = asyncio.create_task(_pipe(reader, up_writer, None))
        cut = await _pipe(up_reader, writer, budget)
        if cut:
            self.cuts += 1
        upload.cancel()
        for w in (writer, up_writer):
            w.close()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, budget: int | None) -> bool:
    """Copy until EOF, or until ``budget`` bytes went through (then True: cut)."""
    try:
        while data := await src.read(65536):
            if budget is not None and len(data) >= budget:
                dst.write(data[:budget])
                await dst.drain()
                return True
            if budget is not None:
                budget -= len(data)
            dst.write(data)
            await dst.drain()
    except (ConnectionError, OSError):
        pass
    return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="127.0.0.1:8000")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--min", type=int, default=300)
    p.add_argument("--max", type=int, default=3000)
    a = p.parse_args()
    host, port = a.target.rsplit(":", 1)
    proxy = CuttingProxy((host, int(port)), min_bytes=a.min, max_bytes=a.max, port=a.port)

    async def forever() -> None:
        await proxy.serve()
        print(f"cutting proxy on {proxy.url} -> {a.target}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(forever())


if __name__ == "__main__":
    main()
