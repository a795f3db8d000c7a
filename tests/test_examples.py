"""The examples run: the web service publishes typed orders (and refuses bad ones with 400,
publishing nothing), the worker fulfils them 8 at a time and dead-letters what is not an
order; the event loop keeps serving HTTP while the worker's handlers run."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import mqabstract
from mqabstract import aio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import web
import worker
from orders import GROUP, TOPIC, Order


async def http(port: int, method: str, path: str, body: object = None) -> tuple[int, dict]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = b"" if body is None else json.dumps(body).encode()
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n"
                 .encode() + data)
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


def test_web_service_publishes_and_worker_fulfils_with_concurrency(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/orders.db"
    done: list[Order] = []
    running = [0, 0]

    async def work(order: Order) -> None:
        running[0] += 1
        running[1] = max(running)
        await asyncio.sleep(0.1)
        running[0] -= 1
        done.append(order)

    async def main() -> None:
        async with await aio.connect(url) as mq:
            server = await web.serve(mq, port=0)
            port = server.sockets[0].getsockname()[1]
            async with server:
                assert await http(port, "GET", "/health") == (200, {"ok": True})
                ids = []
                for i in range(16):
                    status, body = await http(port, "POST", "/orders", {
                        "customer": f"c{i}", "lines": [{"sku": "a", "qty": i + 1}],
                        "express": i % 2 == 0})
                    assert status == 202, body
                    ids.append(body["id"])
                status, body = await http(port, "POST", "/orders",
                                          {"customer": "x", "lines": [{"sku": "a"}]})
                assert status == 400 and "qty" in body["error"]
                assert (await http(port, "GET", "/nope"))[0] == 404
                # Not through the web service: a message that is not an order.
                bad = await mq.publish(TOPIC, {"customer": 7})
                consuming = asyncio.create_task(worker.run(
                    url, concurrency=8, signals=False, max_messages=17, work=work))
                # The loop still serves HTTP while 8 handlers run.
                await asyncio.sleep(0.05)
                assert await http(port, "GET", "/health") == (200, {"ok": True})
                stats = await asyncio.wait_for(consuming, 30)
        assert stats.acked == 16 and stats.invalid == 1 and stats.retried == 0, stats
        assert sorted(o.customer for o in done) == sorted(f"c{i}" for i in range(16))
        assert all(isinstance(o, Order) and o.lines[0].qty >= 1 for o in done)
        assert running[1] == 8
        with mqabstract.connect(url) as sync_mq:
            [dead] = sync_mq.dead_letters(GROUP)
            assert dead.id == bad and dead.reason.startswith("invalid payload")
            assert sync_mq.stats(GROUP).ready == 0

    asyncio.run(asyncio.wait_for(main(), 60))
