"""Hand-built worker views and requests for router unit tests."""

from __future__ import annotations

from libs.protocol import ChatMessage, GenerateRequest, KvEvent, SamplingParams, WorkerBeat
from libs.registry import WorkerRegistry


def beat(
    worker_id: str,
    pool: str = "default",
    model: str = "m",
    running: int = 0,
    waiting: int = 0,
    capacity: int = 10,
    block_size: int = 4,
    draining: bool = False,
    role: str = "aggregated",
    region: str = "",
) -> WorkerBeat:
    return WorkerBeat(
        worker_id=worker_id,
        pool=pool,
        role=role,
        model=model,
        running=running,
        waiting=waiting,
        capacity=capacity,
        block_size=block_size,
        draining=draining,
        region=region,
    )


def registry(*beats: WorkerBeat, ttl_s: float = 10.0) -> WorkerRegistry:
    r = WorkerRegistry(ttl_s)
    for b in beats:
        r.on_beat(b)
    return r


def hold(r: WorkerRegistry, worker_id: str, hashes: list[int]) -> None:
    r.on_kv_event(KvEvent(worker_id=worker_id, model="m", stored=hashes))


def request(
    prompt: str | None = None,
    messages: list[tuple[str, str]] | None = None,
    model: str = "auto",
    max_tokens: int = 16,
    rid: str = "r1",
) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        model=model,
        prompt=prompt if messages is None else None,
        messages=[ChatMessage(r, c) for r, c in messages] if messages is not None else None,
        sampling=SamplingParams(max_tokens=max_tokens),
    )
