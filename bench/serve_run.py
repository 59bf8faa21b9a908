"""Drive one target with one load level: closed-loop concurrency or open-loop Poisson arrivals.

Every run is bounded twice: by its request list (``--num-requests``) and by ``duration_s``
(``--duration``), after which no new request starts; requests already in flight finish or hit
their own ``--request-timeout``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from bench.serve_client import Api, RequestRecord, Sampling, Target, send_request
from bench.workloads import BenchRequest

# Sends one request (with its open-loop scheduled offset) unless the duration cap has passed.
_Send = Callable[[BenchRequest, float | None], Coroutine[Any, Any, None]]


@dataclass(frozen=True, slots=True)
class Load:
    """A load level: ``rate`` (Poisson req/s, open loop) and/or ``concurrency`` (in flight).

    With ``rate`` None the run is closed loop: ``concurrency`` workers each send their next
    request as soon as the previous one ends. With a rate, ``concurrency`` (if set) caps the
    requests in flight; an arrival that finds the cap reached waits, and its ``start_s`` shows
    by how much it slipped from ``scheduled_s``.
    """

    concurrency: int | None = None
    rate: float | None = None
    # A replayed trace (``--trace``): each request's arrival, seconds from the run's start,
    # instead of Poisson arrivals at ``rate``.
    arrivals: tuple[float, ...] | None = None
    trace_name: str = ""

    def __post_init__(self) -> None:
        if self.arrivals is not None:
            if any(b < a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)):
                raise ValueError("trace arrivals must be in time order")
            return
        if self.rate is None and self.concurrency is None:
            raise ValueError("a load needs a concurrency or a rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"--rate must be > 0, got {self.rate}")

    @property
    def label(self) -> str:
        if self.arrivals is not None:
            cap = f",c<={self.concurrency}" if self.concurrency is not None else ""
            return f"trace={self.trace_name or 'file'}{cap}"
        if self.rate is None:
            return f"c={self.concurrency}"
        cap = f",c<={self.concurrency}" if self.concurrency is not None else ""
        return f"rate={self.rate:g}/s{cap}"


@dataclass(slots=True)
class RunResult:
    target: str
    model: str
    load: Load
    records: list[RequestRecord]
    duration_s: float  # from the run's start to the last response's end
    not_sent: int  # requests left unsent when the duration cap was reached


@dataclass(frozen=True, slots=True)
class RunOptions:
    api: Api
    sampling: Sampling
    duration_s: float
    request_timeout_s: float
    seed: int
    progress: bool = True
    # Strait workers' /metrics URLs whose strait_spec_* counters are read around each run.
    worker_metrics: list[str] = field(default_factory=list)


def poisson_arrivals(rate: float, count: int, seed: int) -> list[float]:
    """``count`` arrival offsets (seconds from the start) of a Poisson process of ``rate``/s.

    The first arrival is at 0 so a run never opens with idle time; the rest follow
    exponential gaps drawn from an RNG seeded by ``seed`` and ``rate``.
    """
    rng = random.Random(f"strait-bench-arrivals:{seed}:{rate!r}")
    times, t = [], 0.0
    for i in range(count):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times


async def run_load(
    client: httpx.AsyncClient,
    target: Target,
    model: str,
    requests: Sequence[BenchRequest],
    load: Load,
    options: RunOptions,
) -> RunResult:
    """Send ``requests`` to ``target`` at ``load``; returns every record, in request order."""
    bar = tqdm(
        total=len(requests),
        desc=f"{target.name} {load.label}",
        unit="req",
        disable=not options.progress,
        dynamic_ncols=True,
    )
    records: list[RequestRecord] = []
    errors = 0
    start = time.perf_counter()
    deadline = start + options.duration_s

    # ``model=A|B|C``: request i names the (i mod 3)th, a mix of LoRA adapters and the base.
    models = model.split("|")

    async def one(request: BenchRequest, scheduled_s: float | None) -> None:
        nonlocal errors
        started = time.perf_counter()
        if started >= deadline:
            return  # counted in not_sent
        record = await send_request(
            client,
            target,
            models[request.index % len(models)],
            options.api,
            request,
            options.sampling,
            options.request_timeout_s,
        )
        record.start_s, record.scheduled_s = started - start, scheduled_s
        records.append(record)
        errors += not record.ok
        bar.update(1)
        if errors:
            bar.set_postfix(errors=errors, refresh=False)

    try:
        if load.rate is None and load.arrivals is None:
            assert load.concurrency is not None  # checked by Load
            await _closed_loop(requests, load.concurrency, deadline, one)
        else:
            await _open_loop(requests, load, options.seed, start, deadline, one)
    finally:
        bar.close()
    end = max((start + r.start_s + (r.e2e_s or 0.0) for r in records), default=start)
    records.sort(key=lambda r: r.index)
    return RunResult(
        target=target.name,
        model=model,
        load=load,
        records=records,
        duration_s=end - start,
        not_sent=len(requests) - len(records),
    )


async def _closed_loop(
    requests: Sequence[BenchRequest], concurrency: int, deadline: float, one: _Send
) -> None:
    queue: Iterator[BenchRequest] = iter(requests)

    async def worker() -> None:
        for request in queue:  # the shared iterator hands each request to one worker
            if time.perf_counter() >= deadline:
                return
            await one(request, None)

    workers = [asyncio.create_task(worker()) for _ in range(min(concurrency, len(requests)))]
    try:
        await asyncio.gather(*workers)
    finally:
        for task in workers:
            task.cancel()


async def _open_loop(
    requests: Sequence[BenchRequest],
    load: Load,
    seed: int,
    start: float,
    deadline: float,
    one: _Send,
) -> None:
    if load.arrivals is not None:
        arrivals = list(load.arrivals)
    else:
        assert load.rate is not None
        arrivals = poisson_arrivals(load.rate, len(requests), seed)
    cap = asyncio.Semaphore(load.concurrency) if load.concurrency is not None else None
    tasks: set[asyncio.Task[None]] = set()

    async def capped(request: BenchRequest, scheduled_s: float) -> None:
        assert cap is not None
        async with cap:
            await one(request, scheduled_s)

    try:
        for request, offset in zip(requests, arrivals, strict=True):
            if start + offset >= deadline:
                break
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            coro = capped(request, offset) if cap is not None else one(request, offset)
            tasks.add(asyncio.create_task(coro))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
