"""Where the time of one consumed Kafka message goes: receive + ack, per area, in µs.

    .venv/bin/python bench/profile_kafka.py [--url kafka://127.0.0.1:9092] [--n 20000]
        [--batch 1000] [--many] [--client confluent] [--cprofile]

Publishes ``n`` records (mqabstract ``publish_batch``, so they carry its wire headers),
then reads them with ``receive(batch)`` + ``ack`` each (``--many``: ``ack_many``) and
prints, per message:

* wall time and each thread's CPU time (``/proc``: the application thread, the data
  thread, the group and commit threads, librdkafka's own threads together);
* the application thread's areas, timed with its CPU clock around whole calls (per batch,
  so the timing costs nothing per message): the driver's ``receive`` (its buffer pick,
  the fence, the ``Delivery`` list), the portable layer's part of ``receive`` (the
  ``Message`` objects, the lease), the acks (portable and driver), and the wall time the
  fences waited;
* the data thread's ``_ingest`` (decode + buffer bookkeeping), and, measured again on the
  fetched records afterwards in a tight loop, what wrapping, decoding, a ``Delivery`` and
  a ``Message`` cost alone.

``--cprofile`` also runs the read under cProfile (the application and data threads, each
its own profile; slower, so read it for shares, not µs). No assertions: numbers.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import inspect
import os
import pstats
import secrets
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import mqabstract

try:
    from mqabstract.subscription import Subscription
except ImportError:  # 410b64b: in broker.py
    from mqabstract.broker import Subscription  # type: ignore[no-redef]

CLK = os.sysconf("SC_CLK_TCK")


def thread_cpu() -> dict[str, float]:
    """CPU seconds of every thread of this process, by name (librdkafka's ``rdk:*``
    summed as ``librdkafka``; Python threads by their native name where set)."""
    out: dict[str, float] = defaultdict(float)
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / CLK
        name = NAMES.get(int(tid), "librdkafka" if comm.startswith("rdk:") else "other")
        out[name] += cpu
    return out


NAMES: dict[int, str] = {}


class Areas:
    """Accumulated CPU (thread clock) and wall seconds per named area."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = defaultdict(float)
        self.wall: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner: Any, name: str, area: str) -> None:
        real = getattr(owner, name)

        def timed(*args: Any, **kw: Any) -> Any:
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                return real(*args, **kw)
            finally:
                self.cpu[area] += time.thread_time() - c0
                self.wall[area] += time.perf_counter() - w0
                self.calls[area] += 1

        setattr(owner, name, timed)


def report(acked: int, wall: float, cpu0: dict[str, float], cpu1: dict[str, float],
           app_receive: float, app_ack: float, areas: Areas, args: argparse.Namespace
           ) -> None:
    """The live read's figures, per message."""
    n = max(1, acked)
    us = 1e6 / n
    print(f"{acked} messages (of {args.n}) in {wall:.3f} s: {acked / wall:,.0f} msg/s, "
          f"{wall * us:.2f} µs wall per message; batch {args.batch}, "
          f"{'ack_many' if args.many else 'ack each'}, client {args.client}, "
          f"load {os.getloadavg()[0]:.1f}")
    print("CPU per message, by thread (µs):")
    for name in sorted(cpu1, key=lambda k: -(cpu1[k] - cpu0.get(k, 0.0))):
        print(f"  {name:28s} {(cpu1[name] - cpu0.get(name, 0.0)) * us:7.2f}")
    print("application thread, per message (µs CPU; wall where it waits):")
    recv_drv = areas.cpu["driver receive"]
    fence = areas.cpu["driver receive: fence"]
    print(f"  Subscription.receive         {app_receive * us:7.2f}")
    print(f"    driver receive             {recv_drv * us:7.2f}  "
          f"({areas.calls['driver receive']} calls)")
    print(f"      of which fence           {fence * us:7.2f}  "
          f"(wall {areas.wall['driver receive: fence'] * us:.2f})")
    print(f"    portable part              {(app_receive - recv_drv) * us:7.2f}")
    print(f"  acks                         {app_ack * us:7.2f}")
    print("other areas, per message (µs CPU):")
    for area in sorted(areas.cpu):
        if area.startswith(("data thread", "checkpoints")):
            print(f"  {area:40s} {areas.cpu[area] * us:7.2f}  ({areas.calls[area]} calls)")


def offline(sub: Subscription, inner: Any, msgs: list[Any], args: argparse.Namespace
            ) -> None:
    """The same path again on records already fetched, on this thread alone, the fence
    and the checkpoint commits left out: each area's CPU per message, the best of
    ``--rounds`` (a loaded machine inflates, never deflates, CPU time). The cyclic
    garbage collector is paused meanwhile: where its passes fall depends on what ran
    before, not on the area (the live figures include it)."""
    from mqabstract.backends.kafka.client import TP

    batches: dict[TP, list[Any]] = defaultdict(list)
    for m in msgs:
        batches[TP(m.topic(), m.partition())].append(m)
    parts = {tp: inner.parts.get(tp) for tp in batches}
    if not all(parts.values()):
        print("offline: the partitions are not ours any more; skipped")
        return
    for name in ("receive", "_fence", "_ingest", "_tick", "_poll_ms", "_refresh_data",
                 "_check_stalled", "_checkpoints"):  # the live run's timers off
        vars(inner).pop(name, None)
    vars(inner.data).pop("poll", None)
    vars(inner.data).pop("_group", None)
    inner._fence = lambda *a, **kw: None  # (a commit per receive: measured live above)
    k = len(msgs)
    best: dict[str, float] = {}

    def note(area: str, seconds: float) -> None:
        per = seconds / k * 1e6
        best[area] = min(best.get(area, per), per)

    batched = "records" in inspect.signature(inner._decode).parameters
    gc.collect()
    gc.disable()
    try:
        for _ in range(args.rounds):
            one_round(sub, inner, msgs, args, parts, note, batched)
            gc.collect()
    finally:
        gc.enable()
    total = sum(v for a, v in best.items() if not a.startswith(("  ", "decode", "wrap")))
    total += best["wrap + group (ck_consume)"]
    print(f"offline, one thread, no fence, no garbage collector, per message (µs CPU, best "
          f"of {args.rounds} rounds of {k} records):")
    for area, v in best.items():
        print(f"  {area:30s} {v:7.2f}")
    print(f"  {'total (wrap..checkpoints)':30s} {total:7.2f}")


def one_round(sub: Subscription, inner: Any, msgs: list[Any], args: argparse.Namespace,
              parts: dict[Any, Any], note: Callable[[str, float], None], batched: bool
              ) -> None:
    """One offline round of ``offline``: each area timed once."""

    receive = Subscription.receive
    with inner.lock:  # (the group thread builds checkpoints from them meanwhile)
        for part in parts.values():  # as fetched afresh: nothing pending, nothing done
            part.order.clear()
            part.done.clear()
    c0 = time.thread_time()
    records = inner.data._group(msgs)
    note("wrap + group (ck_consume)", time.thread_time() - c0)
    c0 = time.thread_time()
    for tp, recs in records.items():
        if batched:  # (the driver's decoding, one call per partition or per record)
            inner._decode(tp, recs)
        else:
            for r in recs:
                inner._decode(tp, r, False)
    note("decode (headers -> Rec)", time.thread_time() - c0)
    c0 = time.thread_time()
    inner._ingest(records)
    note("ingest (decode + buffers)", time.thread_time() - c0)
    got: list[mqabstract.Message] = []
    c0 = time.thread_time()
    while True:
        out = receive(sub, args.batch, 0.0)
        if not out:
            break
        got += out
    note("receive (driver + portable)", time.thread_time() - c0)
    c0 = time.thread_time()
    if args.many:
        for lo in range(0, len(got), args.batch):
            sub.ack_many(got[lo:lo + args.batch])
    else:
        for m in got:
            m.ack()
    note("ack_many" if args.many else "ack each", time.thread_time() - c0)
    checkpoints = inner._checkpoints
    two = len(inspect.signature(checkpoints).parameters) >= 2
    c0 = time.thread_time()
    for _ in range(max(1, len(msgs) // args.batch)):
        checkpoints((), None) if two else checkpoints(())
    note("checkpoints (one per batch)", time.thread_time() - c0)
    # the driver's part of receive alone
    inner._ingest(records)
    c0 = time.thread_time()
    tokens = []
    while True:
        out = inner.receive(args.batch, 0.0)
        if not out:
            break
        tokens += [d.receipt for d in out]
    note("  of which driver receive", time.thread_time() - c0)
    c0 = time.thread_time()
    for lo in range(0, len(tokens), args.batch):
        inner.ack(tokens[lo:lo + args.batch]) if args.many else [
            inner.ack((t,)) for t in tokens[lo:lo + args.batch]]
    note("  of which driver ack", time.thread_time() - c0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="kafka://127.0.0.1:9092")
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--many", action="store_true", help="ack_many per batch")
    ap.add_argument("--client", default="confluent")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--rounds", type=int, default=5, help="offline rounds (best taken)")
    args = ap.parse_args()
    url = f"{args.url}{'&' if '?' in args.url else '?'}client={args.client}"
    tag = "p" + secrets.token_hex(4)
    group, pattern, topic = f"prof-{tag}", f"prof.{tag}.#", f"prof.{tag}.t"
    body = b"x" * args.size
    areas = Areas()
    profiles: dict[str, cProfile.Profile] = {}
    with mqabstract.connect(url) as broker:
        broker.declare(group, pattern)
        for lo in range(0, args.n, 1000):
            broker.publish_batch([{"topic": topic, "body": body, "key": f"k{i}"}
                                  for i in range(lo, min(args.n, lo + 1000))])
        from mqabstract.backends.kafka.subscription import KafkaSubscription
        run_data = KafkaSubscription._run_data  # (prof30: DataReader's at main, its own at 410b64b)

        def run_data_named(self: Any) -> None:
            NAMES[threading.get_native_id()] = "data thread"
            if args.cprofile:
                prof = profiles["data thread"] = cProfile.Profile()
                prof.enable()
            run_data(self)

        KafkaSubscription._run_data = run_data_named  # type: ignore[method-assign]
        sub = broker.subscribe(group, pattern, lease=300.0)
        try:
            inner: Any = sub._inner
            NAMES[threading.get_native_id()] = "application"
            NAMES[inner.group_thread.native_id] = "group thread"
            areas.wrap(inner, "receive", "driver receive")
            areas.wrap(inner, "_fence", "driver receive: fence")
            areas.wrap(inner, "_ingest", "data thread: _ingest")
            for name in ("_tick", "_poll_ms", "_refresh_data", "_check_stalled"):
                if hasattr(inner, name):  # (older trees: not all of them)
                    areas.wrap(inner, name, f"data thread: {name}")
            areas.wrap(inner.data, "poll", "data thread: poll (consume + wrap)")
            areas.wrap(inner, "_checkpoints", "checkpoints (group thread, fences)")
            fetched: list[Any] = []
            group_real = inner.data._group

            def keep(msgs: list[Any]) -> Any:
                out = group_real(msgs)
                if len(fetched) < 10000:
                    fetched.extend(msgs)
                return out

            inner.data._group = keep
            receive = Subscription.receive
            got = 0
            deadline = time.monotonic() + 120
            # (the first batch waits for the fetch; timing starts after it)
            first = sub.receive(args.batch, 30.0)
            sub.ack_many(first)
            got += len(first)
            for key in list(areas.cpu):
                areas.cpu[key] = areas.wall[key] = areas.calls[key] = 0
            cpu0 = thread_cpu()
            prof = profiles["application"] = cProfile.Profile() if args.cprofile else None
            if prof is not None:
                prof.enable()
            w0 = time.perf_counter()
            acked = 0
            app_receive = app_ack = 0.0
            while got < args.n and time.monotonic() < deadline:
                c0 = time.thread_time()
                msgs = receive(sub, args.batch, 1.0)
                c1 = time.thread_time()
                if args.many:
                    sub.ack_many(msgs)
                else:
                    for m in msgs:
                        m.ack()
                app_receive += c1 - c0
                app_ack += time.thread_time() - c1
                got += len(msgs)
                acked += len(msgs)
            wall = time.perf_counter() - w0
            if prof is not None:
                prof.disable()
            cpu1 = thread_cpu()
            report(acked, wall, cpu0, cpu1, app_receive, app_ack, areas, args)
            if fetched:
                offline(sub, inner, [m for m in fetched if m.error() is None], args)
        finally:
            sub.close()
        dprof = profiles.get("data thread")
        if dprof is not None:
            dprof.disable()
        broker.delete_group(group)
    if args.cprofile:
        for name, p in profiles.items():
            print(f"\n== cProfile: {name} ==")
            pstats.Stats(p).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
