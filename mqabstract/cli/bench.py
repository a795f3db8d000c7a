"""``mqa bench``: publish and consume throughput and latency against any URL, with plots."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
import uuid
from collections.abc import Sequence
from typing import IO, Any

from ..capabilities import Feature
from ..errors import (
    InvalidArgument,
    MissingDependency,
    MQError,
    Timeout,
    Unsupported,
)
from ..model import OutgoingMessage
from ._base import (
    EXIT_OK,
    UsageError,
    _connect,
    _emit,
)


class Progress:
    """A plain-text progress bar on stderr; on a non-terminal, one line per phase."""

    def __init__(self, label: str, total: int, enabled: bool, stream: IO[str]) -> None:
        self.label, self.total, self.enabled, self.stream = label, max(1, total), enabled, stream
        self.tty = enabled and stream.isatty()
        self._last = 0.0
        self._start = time.monotonic()

    def update(self, done: int) -> None:
        if not self.tty:
            return
        now = time.monotonic()
        if now - self._last < 0.1 and done < self.total:
            return
        self._last = now
        frac = min(1.0, done / self.total)
        bar = "#" * int(frac * 30)
        self.stream.write(f"\r{self.label:<8} [{bar:<30}] {frac * 100:5.1f}% "
                          f"{done}/{self.total}")
        self.stream.flush()

    def finish(self) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.update(self.total)
        secs = time.monotonic() - self._start
        prefix = "\r" if self.tty else ""
        self.stream.write(f"{prefix}{self.label:<8} [{'#' * 30}] done {self.total} in "
                          f"{secs:.2f}s\n")
        self.stream.flush()


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of already sorted values (``nan`` when empty)."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def _summary(name: str, n: int, seconds: float, latencies: list[float]) -> dict[str, Any]:
    lat = sorted(latencies)
    return {
        "phase": name,
        "messages": n,
        "seconds": round(seconds, 4),
        "msg_per_s": round(n / seconds, 1) if seconds > 0 else None,
        "p50_ms": round(percentile(lat, 50) * 1000, 3),
        "p90_ms": round(percentile(lat, 90) * 1000, 3),
        "p99_ms": round(percentile(lat, 99) * 1000, 3),
    }


def _check_plot() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise MissingDependency(
            "--plot needs matplotlib, which is not installed: pip install matplotlib"
        ) from exc


def _plot(path: str, series: dict[str, list[float]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, values in series.items():
        if not values:
            continue
        ms = sorted(v * 1000 for v in values)
        ax.plot(ms, [100 * (i + 1) / len(ms) for i in range(len(ms))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms, log scale)")
    ax.set_ylabel("percentile")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise InvalidArgument(f"cannot write {path}: {exc.strerror or exc}") from exc
    finally:
        plt.close(fig)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.messages < 1 or args.batch < 1 or args.size < 0:
        raise UsageError("--messages and --batch must be ≥ 1, --size ≥ 0")
    if args.plot:
        _check_plot()
    n, size, step = args.messages, args.size, args.batch
    body = os.urandom(size)
    tag = uuid.uuid4().hex[:12]
    topic, group = f"mqa.bench.{tag}", f"mqa-bench-{tag}"
    show = not args.no_progress
    results: list[dict[str, Any]] = []
    series: dict[str, list[float]] = {}
    with _connect(args) as mq:
        caps = mq.capabilities
        if step > 1 and not caps.supports(Feature.BATCH):
            raise Unsupported(f"{mq.backend} does not support batch publish; use --batch 1")
        label = f"{mq.backend} ({mq.url})"
        sub = mq.subscribe(group, topic, lease=60.0)
        try:
            # 1. publish N messages (single or in batches of --batch)
            lat: list[float] = []
            bar = Progress("publish", n, show, sys.stderr)
            t0 = time.perf_counter()
            for start in range(0, n, step):
                k = min(step, n - start)
                s = time.perf_counter()
                if k == 1 and step == 1:
                    mq.publish(topic, body)
                else:
                    mq.publish_batch([OutgoingMessage(topic, body) for _ in range(k)])
                lat.append(time.perf_counter() - s)
                bar.update(start + k)
            results.append(_summary("publish", n, time.perf_counter() - t0, lat))
            bar.finish()
            series["publish"] = lat
            # 2. receive + ack what was published
            lat = []
            bar = Progress("consume", n, show, sys.stderr)
            t0 = time.perf_counter()
            got = 0
            while got < n:
                s = time.perf_counter()
                batch = sub.receive(min(step, n - got), wait=10.0)
                if not batch:
                    raise Timeout(f"bench: only {got} of {n} messages came back within 10 s")
                for msg in batch:
                    msg.ack()
                lat.append(time.perf_counter() - s)
                got += len(batch)
                bar.update(got)
            results.append(_summary("consume", n, time.perf_counter() - t0, lat))
            bar.finish()
            series["receive+ack"] = lat
            # 3. full cycles: publish, receive, ack one message (or batch) at a time
            lat = []
            bar = Progress("cycle", n, show, sys.stderr)
            t0 = time.perf_counter()
            done = 0
            while done < n:
                k = min(step, n - done)
                s = time.perf_counter()
                if k == 1 and step == 1:
                    mq.publish(topic, body)
                else:
                    mq.publish_batch([OutgoingMessage(topic, body) for _ in range(k)])
                left = k
                while left:
                    batch = sub.receive(left, wait=10.0)
                    if not batch:
                        raise Timeout("bench: a published message did not arrive within 10 s")
                    for msg in batch:
                        msg.ack()
                    left -= len(batch)
                lat.append(time.perf_counter() - s)
                done += k
                bar.update(done)
            results.append(_summary("cycle", n, time.perf_counter() - t0, lat))
            bar.finish()
            series["publish+receive+ack"] = lat
        finally:
            sub.close()
            with contextlib.suppress(MQError):  # best effort: the group is empty anyway
                mq.delete_group(group)
    if args.json:
        for row in results:
            _emit({"backend": label, "size": size, "batch": step, **row}, sys.stdout)
    else:
        unit = "per batch" if step > 1 else "per message"
        sys.stdout.write(f"{label}: {n} messages of {size} B, batch {step} "
                         f"(latency {unit})\n")
        sys.stdout.write(f"{'phase':<8} {'msg/s':>10} {'p50 ms':>9} {'p90 ms':>9} "
                         f"{'p99 ms':>9}\n")
        for r in results:
            sys.stdout.write(f"{r['phase']:<8} {r['msg_per_s'] or 0:>10.0f} {r['p50_ms']:>9.3f} "
                             f"{r['p90_ms']:>9.3f} {r['p99_ms']:>9.3f}\n")
    if args.plot:
        _plot(args.plot, series, f"mqa bench: {label}, {size} B, batch {step}")
        sys.stderr.write(f"mqa: wrote {args.plot}\n")
    return EXIT_OK


