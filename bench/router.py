"""Routing overhead: the time of one placement decision at 100 live workers.

    .venv/bin/python -m bench.router [--workers 100] [--requests 5000]

Builds the router's registry in-process from synthetic beats and KV events (no NATS: the
decision itself does no I/O), then times ``Router.decide`` — classify, tokenize and hash the
prompt, look up every worker's prefix overlap, rank by cost — over a mix of requests: chats and
prompts that share one of a few long documents (held by some workers) plus fresh text. Prints
p50/p99/max per tokenizer: the fake backend's word tokenizer, and the real model's tokenizer and
chat template when ``<models.dir>/smollm2-135m-instruct`` is prepared.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from libs.protocol import ChatMessage, GenerateRequest, KvEvent, SamplingParams, WorkerBeat
from libs.registry import WorkerRegistry
from libs.settings import PoolSettings, Settings
from services.router.decision import Decision
from services.router.router import Router

REAL_MODEL = "smollm2-135m-instruct"
BLOCK_SIZE = 16


KINDS = ("raw prompt: doc + question", "chat: system doc + question", "chat: doc + 6 turns + q")


def documents(rng: random.Random, n: int, words: int) -> list[str]:
    vocab = [f"w{i}" for i in range(5000)]
    return [" ".join(rng.choice(vocab) for _ in range(words)) for _ in range(n)]


def requests(rng: random.Random, docs: list[str], n: int) -> list[GenerateRequest]:
    out = []
    for i in range(n):
        doc = rng.choice(docs)
        question = f"question {i}: what does part {rng.randrange(100)} say about item {i % 37}?"
        kind = i % 3
        if kind == 0:
            out.append(GenerateRequest(request_id=f"r{i}", prompt=f"{doc}\n{question}"))
        elif kind == 1:
            msgs = [ChatMessage("system", doc), ChatMessage("user", question)]
            out.append(GenerateRequest(request_id=f"r{i}", messages=msgs))
        else:
            history = [
                ChatMessage("user" if t % 2 == 0 else "assistant", f"turn {t} of {i}")
                for t in range(6)
            ]
            msgs = [ChatMessage("system", doc), *history, ChatMessage("user", question)]
            sampling = SamplingParams(max_tokens=rng.choice([16, 256, 1024]))
            out.append(GenerateRequest(request_id=f"r{i}", messages=msgs, sampling=sampling))
    return out


def build(
    settings: Settings, pool: str, model: str, n_workers: int, docs: list[str], rng: random.Random
) -> Router:
    registry = WorkerRegistry(ttl_s=3600.0)
    router = Router(None, None, settings, registry, rng=rng)  # type: ignore[arg-type]
    for w in range(n_workers):
        registry.on_beat(
            WorkerBeat(
                worker_id=f"{pool}-{w}",
                pool=pool,
                role="aggregated",
                model=model,
                running=rng.randrange(0, 48),
                waiting=rng.randrange(0, 4),
                capacity=64,
                block_size=BLOCK_SIZE,
            )
        )
    # Each document's blocks live on ~10% of the workers (as the workers' KV events say).
    for d, doc in enumerate(docs):
        probe = GenerateRequest(request_id=f"doc{d}", messages=[ChatMessage("system", doc)])
        # The beats above carry no model_id, so ``decide`` hashes under the model name.
        hashes, _ = router.prefix(probe, pool, model, model, BLOCK_SIZE)
        for w in rng.sample(range(n_workers), max(n_workers // 10, 1)):
            registry.on_kv_event(KvEvent(worker_id=f"{pool}-{w}", model=model, stored=hashes))
    return router


def measure(router: Router, reqs: list[GenerateRequest]) -> tuple[list[float], int]:
    times, hits = [], 0
    for r in reqs:
        t0 = time.perf_counter()
        d = router.decide(r)
        times.append(time.perf_counter() - t0)
        assert isinstance(d, Decision)
        hits += d.ranked[0].overlap_blocks > 0
    return times, hits


def report(label: str, times: list[float], hits: int) -> None:
    times = sorted(times)
    us = [t * 1e6 for t in times]
    p50 = statistics.median(us)
    p99 = us[int(len(us) * 0.99) - 1]
    print(
        f"{label:<34} n={len(us):<6} p50={p50:7.1f} us  p99={p99:7.1f} us  max={us[-1]:8.1f} us"
        f"  placed on a prefix holder: {hits / len(us):.0%}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=100)
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--doc-words", type=int, default=800)
    ap.add_argument("--docs", type=int, default=20)
    args = ap.parse_args()
    rng = random.Random(0)
    docs = documents(rng, args.docs, args.doc_words)
    reqs = requests(rng, docs, args.requests)
    print(f"{args.workers} live workers, {args.docs} shared documents of {args.doc_words} words")

    fake = Settings()
    fake.pools = [PoolSettings(name="default", model="fake-model", backend="fake")]
    router = build(fake, "default", "fake-model", args.workers, docs, rng)
    measure(router, reqs[:200])  # warm the per-message token cache like a running router
    report("fake word tokenizer", *measure(router, reqs))
    by_kind(router, "  ", reqs)

    real = Settings()
    if not (Path(real.models.dir) / REAL_MODEL / "tokenizer.json").exists():
        print(f"{REAL_MODEL} not prepared under {real.models.dir}: real tokenizer skipped")
        return
    real.pools = [PoolSettings(name="default", model=REAL_MODEL)]
    router = build(real, "default", REAL_MODEL, args.workers, docs, rng)
    router.hashers.hasher("default", REAL_MODEL)._cache.data.clear()  # type: ignore[attr-defined]
    report(f"{REAL_MODEL} cold cache", *measure(router, reqs[:500]))
    report(f"{REAL_MODEL} warm cache", *measure(router, reqs))
    by_kind(router, "  ", reqs)


def by_kind(router: Router, indent: str, reqs: list[GenerateRequest]) -> None:
    for k, name in enumerate(KINDS):
        report(indent + name, *measure(router, reqs[k::3]))


if __name__ == "__main__":
    main()
