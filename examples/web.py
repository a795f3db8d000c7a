"""A small asyncio web service that publishes orders (stdlib HTTP, no framework).

    python examples/web.py [URL] [--port 8080]
    curl -X POST localhost:8080/orders -d '{"customer": "ada", "lines": [{"sku": "a", "qty": 2}]}'

``POST /orders`` checks the JSON against ``Order`` (400 with the reason when it does not
fit: nothing is published), publishes it through ``mqabstract.aio`` and answers 202 with
the message id once the broker confirmed it. ``GET /health`` answers 200. The event loop
keeps serving while a publish waits on the broker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from orders import GROUP, TOPIC, Order

import mqabstract
from mqabstract import aio
from mqabstract.typed import Model

MAX_BODY = 64 * 1024
CHECK = Model(Order)


async def handle(mq: aio.AsyncBroker, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
    try:
        request = (await reader.readline()).decode("latin-1").split()
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip() or 0)
        if length > MAX_BODY:
            status, body = 413, {"error": "body too large"}
        else:
            payload = await reader.readexactly(length) if length else b""
            status, body = await route(mq, request[:2], payload)
    except (ValueError, IndexError, asyncio.IncompleteReadError):
        status, body = 400, {"error": "malformed request"}
    data = json.dumps(body).encode()
    writer.write(f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    await writer.drain()
    writer.close()


async def route(mq: aio.AsyncBroker, request: list[str], payload: bytes
                ) -> tuple[int, dict[str, object]]:
    if request == ["GET", "/health"]:
        return 200, {"ok": True}
    if request != ["POST", "/orders"]:
        return 404, {"error": "not found"}
    try:
        order = CHECK.load(json.loads(payload))
    except (ValueError, mqabstract.InvalidPayload) as exc:
        return 400, {"error": str(exc)}
    try:
        msg_id = await mq.publish(TOPIC, order, key=order.customer)
    except mqabstract.MQError as exc:  # the broker is down: tell the client to retry
        return 503, {"error": type(exc).__name__, "retryable": exc.retryable}
    return 202, {"id": msg_id}


_REASONS = {200: "OK", 202: "Accepted", 400: "Bad Request", 404: "Not Found",
            413: "Payload Too Large", 503: "Service Unavailable"}


async def serve(mq: aio.AsyncBroker, host: str = "127.0.0.1", port: int = 8080
                ) -> asyncio.Server:
    """Start serving (``port=0``: any free port; read it from the returned server). The
    workers' group is declared first, so orders wait for a worker that is not up yet."""
    await mq.declare(GROUP, "orders.#", max_attempts=5)
    return await asyncio.start_server(lambda r, w: handle(mq, r, w), host, port)


async def main(url: str | None, port: int) -> None:
    async with await aio.connect(url) as mq:
        server = await serve(mq, port=port)
        print(f"publishing to {mq.url}; listening on", server.sockets[0].getsockname())
        async with server:
            await server.serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="publish orders over HTTP")
    ap.add_argument("url", nargs="?")
    ap.add_argument("--port", type=int, default=8080)
    args = ap.parse_args()
    asyncio.run(main(args.url, args.port))
