"""Tail latency of the engine's schedule on the real model: what a step carries decides how long
the streams in it wait (issue 38, docs/performance.md "Tail latency").

    .venv/bin/python -m bench.tail --targets 0,100,150            # every scenario
    .venv/bin/python -m bench.tail --scenario long --targets 0,120

One engine in this process (the default pool's model and weight format, ``--compile`` as the
settings say unless given), driven step by step with real time; every scenario runs once per
``engine.itl_target_ms`` in ``--targets`` (0: off, fixed ``prefill_chunk_tokens`` chunks):

- ``chat``: ``--streams`` closed-loop streams of ``chat-60w`` prompts (bench/workloads.py,
  the chat template applied), ``--max-tokens`` each (ignore_eos), ``--requests`` in all;
- ``long``: ``--streams`` // 2 chat streams running, then one prompt of ``--long-tokens`` tokens
  arrives; the chat streams' ITL p99 with it, and in the same run's window without it;
- ``mixed``: 25% long answers (512 tokens) and 75% short (32) in ``--streams`` closed-loop
  streams; the short answers' E2E p99, against a run of short answers alone;
- ``batch``: ``--streams`` closed-loop chat streams (``--requests`` in all) alone, beside
  ``--batch-rows`` batch-class requests (``--batch-tokens`` each, replaced as they end) with
  ``engine.batch_yields_to_prompts`` on, and beside them with it off; ``--rounds`` rounds, the
  three runs in a rotating order; the streams' TTFT p50/p99 of each, pooled, and each round's
  beside/alone p99 ratio (issue 39, decision 0030); before them ``--arrivals`` single
  interactive prompts among the streams and rows, nothing queued (``arrival_ttft``). Not in
  ``all``.

It prints, per target: output tok/s, TTFT p50/p99, ITL p50/p99 (a stream's gap between tokens),
steps over the target; the served comparison with llama-server is ``bench.serve`` (this one is
the diagnosis: the engine alone, no NATS, no HTTP).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.stats import pct
from bench.workloads import generate
from libs.protocol import Priority, SamplingParams

SHORT, LONG = 32, 512  # the mixed scenario's answer lengths
LONG_SHARE = 4  # one request in LONG_SHARE is long


@dataclass
class Stream:
    request_id: str
    sent: float
    tokens: list[float] = field(default_factory=list)  # arrival time of each output token
    done: float | None = None
    max_tokens: int = 0
    priority: Priority = "interactive"


def gaps(streams: list[Stream]) -> list[float]:
    out: list[float] = []
    for st in streams:
        out += [b - a for a, b in zip(st.tokens, st.tokens[1:], strict=False)]
    return out


class Driver:
    """Runs the engine until every stream is done, starting streams as ``arrivals`` says."""

    def __init__(
        self,
        engine: Any,
        prompts: Callable[[int], tuple[list[int], int]],
        batch_prompts: Callable[[int], tuple[list[int], int]] | None = None,
    ) -> None:
        self.engine = engine
        self.prompts = prompts
        self.batch_prompts = batch_prompts
        self.streams: dict[str, Stream] = {}
        self.n = 0  # interactive requests started
        self.n_batch = 0
        self.tag = time.time_ns()
        self.step_s: list[float] = []  # each step's wall time

    def start(self, priority: Priority = "interactive") -> Stream:
        if priority == "batch":
            assert self.batch_prompts is not None
            ids, max_tokens = self.batch_prompts(self.n_batch)
            rid = f"b{self.tag}-{self.n_batch}"
            self.n_batch += 1
        else:
            ids, max_tokens = self.prompts(self.n)
            rid = f"t{self.tag}-{self.n}"
            self.n += 1
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(rid, ids, sampling, priority)
        st = Stream(rid, time.perf_counter(), max_tokens=max_tokens, priority=priority)
        self.streams[rid] = st
        return st

    def step(self) -> list[Stream]:
        """One engine step; the streams that ended in it."""
        ended = []
        t0 = time.perf_counter()
        outs = self.engine.step()
        now = time.perf_counter()
        self.step_s.append(now - t0)
        for o in outs:
            st = self.streams.get(o.request_id)
            if st is None:
                continue
            st.tokens += [now] * len(o.chunk.token_ids)
            if o.chunk.finish_reason is not None and st.done is None:
                st.done = now
                ended.append(st)
        return ended

    def closed_loop(self, concurrency: int, total: int, batch_rows: int = 0) -> list[Stream]:
        """``total`` interactive requests, ``concurrency`` at a time; beside them
        ``batch_rows`` batch-class requests, each replaced as it ends, aborted at the end.
        Returns the interactive streams."""
        for _ in range(min(concurrency, total)):
            self.start()
        for _ in range(batch_rows):
            self.start("batch")
        finished: list[Stream] = []
        while len(finished) < total:
            for st in self.step():
                if st.priority == "batch":
                    self.start("batch")
                    continue
                finished.append(st)
                if self.n < total:
                    self.start()
        for st in self.streams.values():
            if st.done is None:
                self.engine.abort_request(st.request_id)
        return finished


def report(
    name: str, streams: list[Stream], wall: float, over: float, preempted: int
) -> dict[str, float]:
    ttft = [st.tokens[0] - st.sent for st in streams if st.tokens]
    itl = gaps(streams)
    toks = sum(len(st.tokens) for st in streams)
    row = {
        "tok_s": toks / wall,
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p99": pct(ttft, 0.99),
        "itl_p50": pct(itl, 0.5),
        "itl_p99": pct(itl, 0.99),
        "over": over,
    }
    print(
        f"  {name:<28} {row['tok_s']:7.1f} tok/s  TTFT p50 {1000 * row['ttft_p50']:7.0f} "
        f"p99 {1000 * row['ttft_p99']:7.0f} ms  ITL p50 {1000 * row['itl_p50']:6.0f} "
        f"p99 {1000 * row['itl_p99']:6.0f} ms  steps over target {over:.0f}, "
        f"preemptions {preempted}",
        flush=True,
    )
    return row


def arrival_ttft(
    engine: Any, prompts: Callable[[int, int], Callable[[int], tuple[list[int], int]]], args: Any
) -> None:
    """TTFT of one interactive prompt at a time (``--arrivals`` of them) arriving among
    ``--streams`` decoding streams: beside ``--batch-rows`` decoding batch rows that yield to
    it and that share its step (alternating), then alone (the batch rows aborted). Nothing
    queues: each TTFT is the step that computes the prompt, what the batch's rows add to it."""
    tag, keep_tokens = time.time_ns(), 1500  # the streams and rows decode throughout
    chat, bulk, probe = prompts(7, keep_tokens), prompts(8, keep_tokens), prompts(9, 1)
    sampling = SamplingParams(max_tokens=keep_tokens, temperature=0.0, ignore_eos=True)
    kept = [f"k{tag}-{i}" for i in range(args.streams)]
    rows = [f"kb{tag}-{i}" for i in range(args.batch_rows)]
    for i, rid in enumerate(kept):
        engine.add_request(rid, chat(i)[0], sampling)
    for i, rid in enumerate(rows):
        engine.add_request(rid, bulk(i)[0], sampling, "batch")
    decoding: set[str] = set()
    while len(decoding) < len(kept) + len(rows):
        decoding |= {o.request_id for o in engine.step() if o.chunk.token_ids}
    n = 0

    def arrive() -> float:
        nonlocal n
        rid, n = f"p{tag}-{n}", n + 1
        engine.add_request(rid, probe(n)[0], SamplingParams(max_tokens=1, temperature=0.0))
        t0 = time.perf_counter()
        while not any(o.request_id == rid and o.chunk.token_ids for o in engine.step()):
            pass
        ttft = time.perf_counter() - t0
        engine.step()  # a decode step between arrivals
        return ttft

    ttft: dict[str, list[float]] = {"alone": [], "yielding": [], "sharing": []}
    for i in range(args.arrivals):
        for c in ("yielding", "sharing") if i % 2 == 0 else ("sharing", "yielding"):
            engine.scheduler.batch_yields_to_prompts = c == "yielding"
            ttft[c].append(arrive())
    for rid in rows:
        engine.abort_request(rid)
    for _ in range(args.arrivals):
        ttft["alone"].append(arrive())
    for rid in kept:
        engine.abort_request(rid)
    engine.scheduler.batch_yields_to_prompts = True
    for c, t in ttft.items():
        print(
            f"  one arrival among {args.streams} streams, {c:<9}: TTFT p50 "
            f"{1000 * pct(t, 0.5):.0f} p99 {1000 * pct(t, 0.99):.0f} ms "
            f"(p50 {pct(t, 0.5) / pct(ttft['alone'], 0.5):.2f}x alone's)",
            flush=True,
        )


def batch_scenario(
    engine: Any, prompts: Callable[[int, int], Callable[[int], tuple[list[int], int]]], args: Any
) -> None:
    """The ``batch`` scenario: per round, the streams alone, beside batch rows that yield to
    interactive prompts, and beside batch rows that share their steps, in a rotating order."""
    conditions = ("alone", "yielding", "sharing")
    ttft: dict[str, list[float]] = {c: [] for c in conditions}
    ratios: dict[str, list[float]] = {c: [] for c in conditions[1:]}
    batch_tok_s: dict[str, list[float]] = {c: [] for c in conditions[1:]}
    if args.arrivals:
        arrival_ttft(engine, prompts, args)
    if not args.rounds:
        return
    for r in range(args.rounds):
        p99: dict[str, float] = {}
        for k in range(len(conditions)):
            c = conditions[(r + k) % len(conditions)]
            engine.scheduler.batch_yields_to_prompts = c != "sharing"
            seed = 100 * r  # the same prompts in each run of a round (tagged: no cache hits)
            d = Driver(engine, prompts(seed, args.max_tokens), prompts(seed + 1, args.batch_tokens))
            t0 = time.perf_counter()
            streams = d.closed_loop(
                args.streams, args.requests, 0 if c == "alone" else args.batch_rows
            )
            wall = time.perf_counter() - t0
            t = [st.tokens[0] - st.sent for st in streams if st.tokens]
            ttft[c] += t
            p99[c] = pct(t, 0.99)
            if c != "alone":
                done = sum(len(st.tokens) for st in d.streams.values() if st.priority == "batch")
                batch_tok_s[c].append(done / wall)
        for c in conditions[1:]:
            ratios[c].append(p99[c] / p99["alone"])
        print(
            f"  round {r}: TTFT p99 alone {1000 * p99['alone']:.0f} ms, batch yielding "
            f"{1000 * p99['yielding']:.0f} ({ratios['yielding'][-1]:.2f}x), sharing "
            f"{1000 * p99['sharing']:.0f} ({ratios['sharing'][-1]:.2f}x)",
            flush=True,
        )
    for c in conditions:
        line = (
            f"  {c:<9} {len(ttft[c])} requests: TTFT p50 {1000 * pct(ttft[c], 0.5):.0f} "
            f"p99 {1000 * pct(ttft[c], 0.99):.0f} ms"
        )
        if c != "alone":
            q = sorted(ratios[c])
            line += (
                f", pooled p99 / alone {pct(ttft[c], 0.99) / pct(ttft['alone'], 0.99):.2f}x, "
                f"rounds' ratio median {statistics.median(q):.2f}x ({q[0]:.2f}-{q[-1]:.2f}), "
                f"batch {statistics.median(batch_tok_s[c]):.0f} tok/s"
            )
        print(line, flush=True)


def over_target() -> float:
    from libs.engine import metrics

    samples = (s for m in metrics.STEPS_OVER_TARGET.collect() for s in m.samples)
    return sum(s.value for s in samples if s.name.endswith("_total"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.tail", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", choices=("all", "chat", "long", "mixed", "batch"), default="all")
    p.add_argument("--targets", default="0,120", help="engine.itl_target_ms values, ms")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--long-tokens", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=6, help="batch: closed-loop rounds (0: none)")
    p.add_argument("--arrivals", type=int, default=30, help="batch: single arrivals of each")
    p.add_argument("--batch-rows", type=int, default=16, help="batch: batch requests running")
    p.add_argument("--batch-tokens", type=int, default=16, help="batch: a batch answer's tokens")
    p.add_argument("--compile", choices=("settings", "on", "off"), default="settings")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--verbose", action="store_true", help="list steps over the target")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from libs.engine.engine import LLMEngine
    from libs.engine.loader import load_model
    from libs.models import prepare_model
    from libs.settings import get_settings

    settings = get_settings()
    path = prepare_model(args.model, settings)
    tok: Any = AutoTokenizer.from_pretrained(path)
    es = settings.engine.model_copy()
    es.max_num_seqs = max(es.max_num_seqs, args.streams + 1)
    es.max_model_len = max(es.max_model_len, args.long_tokens + args.max_tokens + 64)
    if args.compile != "settings":
        es.compile = args.compile == "on"
    model = load_model(path, es)
    print(f"loading the engine (compile {es.compile}, weights {es.quantization})...", flush=True)
    engine = LLMEngine(model, tok, es, args.model)

    runs = iter(range(1_000_000))

    def chat_prompt(seed: int) -> Callable[[int], tuple[list[int], int]]:
        # A tag of its own in every run: no prefix-cache hits across runs (chat-60w prompts
        # of one seed differ among themselves anyway).
        reqs, tag = generate("chat-60w", 4096, seed=seed), f"Run {next(runs)}. "

        def make(i: int) -> tuple[list[int], int]:
            msgs = [{"role": "user", "content": tag + reqs[i].user}]
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            return list(ids if isinstance(ids, list) else ids["input_ids"]), args.max_tokens

        return make

    def long_prompt(n: int) -> list[int]:
        words = f"Run {next(runs)}. " + " ".join(r.user for r in generate("chat-60w", 400))
        return list(tok(words, add_special_tokens=False)["input_ids"])[:n]

    # Warm-up: each shape once (decode batches, chunks, a long prompt) and the step-cost
    # model's first fit.
    warm = Driver(engine, chat_prompt(1000))
    warm.closed_loop(args.streams, args.streams)
    engine.add_request(
        "warm-long", long_prompt(args.long_tokens), SamplingParams(max_tokens=2, ignore_eos=True)
    )
    while engine.has_unfinished():
        engine.step()

    fit = engine.step_cost.decode.fit()
    print(
        f"step cost after warm-up: decode {fit}, per prompt token "
        f"{engine.step_cost.per_prefill_token * 1000:.3f} ms",
        flush=True,
    )
    slow: list[tuple[int, int, int, float]] = []  # (rows, prompt tokens, allowance, seconds)
    observe = engine._observe

    def watch(sched: Any, seconds: float) -> None:
        target = engine.scheduler.itl_target_s
        if args.verbose and target > 0 and seconds > target:
            allowed = sched.budget.tokens if sched.budget is not None else -1
            slow.append((sched.num_decode_rows, sched.num_prefill_tokens, allowed, seconds))
        observe(sched, seconds)

    engine._observe = watch
    targets = [float(x) for x in args.targets.split(",") if x.strip()]
    for t in targets:
        engine.scheduler.itl_target_s = t / 1000
        print(f"engine.itl_target_ms = {t:g}", flush=True)
        if args.scenario in ("all", "chat"):
            before, pre = over_target(), engine.scheduler.num_preemptions
            d = Driver(engine, chat_prompt(int(t) + 1))
            t0 = time.perf_counter()
            streams = d.closed_loop(args.streams, args.requests)
            report(
                f"chat {args.streams} streams", streams, time.perf_counter() - t0,
                over_target() - before, engine.scheduler.num_preemptions - pre,
            )  # fmt: skip
            for rows, prompt, allowed, sec in slow[:10]:
                print(f"    over: {rows} rows + {prompt} prompt tokens (allowed {allowed}): "
                      f"{1000 * sec:.0f} ms")  # fmt: skip
            slow.clear()
            print(
                f"    steps {len(d.step_s)}: p50 {1000 * pct(d.step_s, 0.5):.0f} ms, "
                f"p99 {1000 * pct(d.step_s, 0.99):.0f} ms, max {1000 * max(d.step_s):.0f} ms",
                flush=True,
            )
        if args.scenario in ("all", "long"):
            before = over_target()
            n_chat = args.streams // 2
            d = Driver(engine, chat_prompt(int(t) + 2))
            live = [d.start() for _ in range(n_chat)]
            # Let them all reach decoding, then note the window before the long prompt.
            while any(not st.tokens for st in live):
                d.step()
            for _ in range(20):
                d.step()
            mark = time.perf_counter()
            long_ids = long_prompt(args.long_tokens)
            engine.add_request(
                f"long-{time.time_ns()}",
                long_ids,
                SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
            )
            long_sent = time.perf_counter()
            long_first = None
            while engine.has_unfinished():
                outs = engine.step()
                now = time.perf_counter()
                for o in outs:
                    st = d.streams.get(o.request_id)
                    if st is not None:
                        st.tokens += [now] * len(o.chunk.token_ids)
                    elif long_first is None and o.chunk.token_ids:
                        long_first = now
            quiet = [
                b - a
                for st in live
                for a, b in zip(st.tokens, st.tokens[1:], strict=False)
                if b <= mark
            ]
            busy = [
                b - a
                for st in live
                for a, b in zip(st.tokens, st.tokens[1:], strict=False)
                if b > long_sent and (long_first is None or a < long_first)
            ]
            print(
                f"  long prompt of {len(long_ids)} tokens among {n_chat} streams: their ITL p99 "
                f"{1000 * pct(quiet, 0.99):.0f} ms before it, {1000 * pct(busy, 0.99):.0f} ms "
                f"while it is prefilled ({pct(busy, 0.99) / pct(quiet, 0.99):.2f}x); its TTFT "
                f"{(long_first or time.perf_counter()) - long_sent:.2f} s; steps over target "
                f"{over_target() - before:.0f}",
                flush=True,
            )
        if args.scenario == "batch":

            def prompts(
                seed: int, max_tokens: int, t: float = t
            ) -> Callable[[int], tuple[list[int], int]]:
                make = chat_prompt(int(t) + 4 + seed)
                return lambda i: (make(i)[0], max_tokens)

            batch_scenario(engine, prompts, args)
        if args.scenario in ("all", "mixed"):
            for label, share in (("short only", 0), ("25% long", LONG_SHARE)):
                base = chat_prompt(int(t) + 3)

                def mixed(i: int, share: int = share, base: Any = base) -> tuple[list[int], int]:
                    ids, _ = base(i)
                    return ids, LONG if share and i % share == 0 else SHORT

                d = Driver(engine, mixed)
                t0 = time.perf_counter()
                streams = d.closed_loop(args.streams, args.requests)
                short = [st for st in streams if st.max_tokens == SHORT]
                e2e = [st.done - st.sent for st in short if st.done is not None]
                print(
                    f"  mixed, {label:<10}: short answers' E2E p50 "
                    f"{statistics.median(e2e):.2f} s p99 {pct(e2e, 0.99):.2f} s "
                    f"({len(short)} short, {time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
