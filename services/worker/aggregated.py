"""The aggregated worker: one worker computes the prompt and generates every token.

The default deployment (``worker.role = "aggregated"``, ``strait worker``). Per assignment
(``Worker.on_assignment`` accepted it):

    serve ─► fresh:    Routed echo? → prepare → generate → TokenDelta… → Finished
          └► migrated: its lost worker's output is replayed into the engine (not streamed
                       again); the stream goes on at ``Migration.next_seq``

``generate`` is the one loop under both, and under the decode worker's handed-off requests
(``services.decode.worker``): a :class:`Start` says where a stream starts and what its worker
already holds. Errors and cancels end the stream through ``Worker.fail``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context

from libs.backend import GenerationChunk, PreparedPrompt, Resume
from libs.engine.tools import ToolCallCollector, ToolSpec, constraint_kind
from libs.flow.tenant import engine_tenant, tenant_of
from libs.protocol import Assignment, HandoffOffer, Routed, Usage
from libs.wire.stream_writer import StreamWriter
from services.worker import metrics
from services.worker.base import Worker
from services.worker.coalesce import DeltaHold


@dataclass(frozen=True)
class Start:
    """How one request's stream starts on this worker.

    ``first_seq``: the seq of this worker's first stream message. ``resume``: output tokens
    the engine takes as already sampled (``Resume``). ``echo_route``: send ``Routed`` first.
    ``handoff``: the request was prefilled by a prefill worker: its blocks are imported, its
    prompt token ids are the offer's, its ``prefill_s`` counts in the time to first token and
    its cached tokens are the usage's; the request is in its decode phase from the start."""

    first_seq: int
    resume: Resume | None = None
    echo_route: bool = False
    handoff: HandoffOffer | None = None

    @classmethod
    def fresh(cls, a: Assignment) -> Start:
        return cls(1, echo_route=a.request.want_route)

    @classmethod
    def migrated(cls, a: Assignment) -> Start:
        assert a.migration is not None
        return cls(a.migration.next_seq, Resume(replayed=a.migration.output_token_ids))

    @classmethod
    def handed_off(cls, offer: HandoffOffer) -> Start:
        mig = offer.assignment.migration
        replayed = mig.output_token_ids if mig is not None else []
        if offer.first_token_id is not None:
            resume: Resume | None = Resume(offer.first_token_id, offer.first_logprobs, replayed)
        else:  # n > 1: the decode side samples every choice's first token itself
            resume = Resume(replayed=replayed) if mig is not None else None
        return cls(offer.next_seq, resume, handoff=offer)


@dataclass
class _Run:
    """One request's state while it runs here, shared by :meth:`AggregatedWorker.generate`'s
    steps. ``ttft``: seconds to the first token as the client sees it from the workers' side
    (``ttft_offset``: a handed-off request already spent ``prefill_s`` on the prefill worker);
    ``spec``: speculative tokens proposed and kept so far; ``phase``: the current phase's span
    under ``phase_ctx``."""

    a: Assignment
    start: Start
    out: StreamWriter
    started: float
    span: trace.Span
    phase_ctx: Context
    phase: trace.Span
    usage: Usage = field(default_factory=Usage)
    ttft: float | None = None
    last_token_at: float = 0.0
    spec: tuple[int, int] = (0, 0)

    @property
    def ttft_offset(self) -> float:
        return self.start.handoff.prefill_s if self.start.handoff else 0.0


class AggregatedWorker(Worker):
    async def serve(self, a: Assignment, parent: Context) -> None:
        start = Start.fresh(a) if a.migration is None else Start.migrated(a)
        await self.generate(a, parent, start)

    async def generate(self, a: Assignment, parent: Context, start: Start) -> None:
        """Run one request to its end on the stream, from ``start``."""
        run = self._open(a, parent, start)
        status, error_code = "ok", ""
        try:
            await self._stream(run)
        except (Exception, asyncio.CancelledError) as e:
            status, error_code = await self.fail(run.out, e)
        finally:
            self._close(run, status, error_code)

    def _open(self, a: Assignment, parent: Context, start: Start) -> _Run:
        """The request's stream writer (kept for resends) and spans."""
        req, mig = a.request, a.migration
        out = StreamWriter(
            self.nc,
            req.reply_subject or self.subjects.stream(req.request_id),
            req.request_id,
            start.first_seq,
            owner=self.owns_streams,
            keep=self.settings.worker.resend_window,
            key=req.key,
        )
        self.writers[req.key] = out
        started = time.perf_counter()
        span = self.begin("worker.generate", a, parent)
        phase_ctx = trace.set_span_in_context(span)
        # Both phases run here: "prefill" until the first token, then "decode". A handed-off
        # request is in its decode phase from the start.
        phase_name = "decode" if start.handoff else "prefill"
        phase = self._tracer.start_span(phase_name, context=phase_ctx)
        if mig is not None:
            span.set_attribute("strait.migrated_from", mig.from_worker)
            span.set_attribute("strait.replayed_tokens", len(mig.output_token_ids))
        return _Run(a, start, out, started, span, phase_ctx, phase)

    async def _stream(self, run: _Run) -> None:
        """Prepare the prompt, then stream every chunk the engine generates, then Finished."""
        a, start, out, usage = run.a, run.start, run.out, run.usage
        req, mig = a.request, a.migration
        if start.echo_route:
            await out.send(Routed(seq=out.next_seq(), request_id=req.request_id, route=a.route))
        tools = ToolSpec.of(req)
        prompt = await self._prepare(a, start, tools)
        usage.prompt_tokens = len(prompt.token_ids)
        run.span.set_attribute("strait.constraint", constraint_kind(req))
        calls = ToolCallCollector(tools, req.sampling.n) if tools and tools.parsed else None
        if mig is not None:
            # The lost worker's tokens count once, here; their text feeds the call parser.
            usage.completion_tokens = len(mig.output_token_ids)
            if calls is not None:
                calls.texts[0] = mig.output_text
        if mig is not None and mig.finished and start.handoff is None:
            # Every delta was streamed; only the stream's end was lost with the worker.
            await self.send_finished(out, a, usage, None, time.perf_counter() - run.started)
            return
        tokens = self.settings.worker.batch_delta_tokens
        hold = DeltaHold(tokens) if req.priority == "batch" and tokens > 1 else None
        gen = self.backend.generate(
            req.key, prompt, req.sampling, req.priority, start.resume, tenant=engine_tenant(req)
        )
        async for chunk in gen:
            self._observe(run, chunk)
            found = calls.add(chunk) if calls else None
            if hold is not None:
                held = hold.add(chunk, last=found is not None)
                if held is None:
                    continue
                chunk = held
            await self.send_chunk(out, chunk, found)
        total = run.ttft_offset + time.perf_counter() - run.started
        await self.send_finished(out, a, usage, run.ttft, total)

    def _observe(self, run: _Run, chunk: GenerationChunk) -> None:
        """One engine chunk's timings (TTFT, then ITL), usage and speculation counts; the
        first token ends the prefill phase."""
        req, handoff, usage = run.a.request, run.start.handoff, run.usage
        now = time.perf_counter()
        if run.ttft is None and (chunk.token_ids or chunk.finish_reason):
            run.ttft = run.ttft_offset + now - run.started
            run.span.add_event("first_token")
            tenant = metrics.tenant_label(tenant_of(req))
            metrics.TTFT.labels(req.priority, tenant).observe(run.ttft)
            if handoff is None:
                self._end_prefill(run, chunk.num_cached_tokens)
        elif chunk.token_ids and chunk.index == 0:
            # A step that kept speculated tokens delivers several at once: each of them
            # waited its share.
            itl = metrics.ITL.labels(req.priority, metrics.tenant_label(tenant_of(req)))
            for _ in chunk.token_ids:
                itl.observe((now - run.last_token_at) / len(chunk.token_ids))
        if chunk.token_ids and chunk.index == 0:
            run.last_token_at = now
        run.spec = (chunk.num_spec_proposed, chunk.num_spec_accepted)
        usage.completion_tokens += len(chunk.token_ids)
        usage.cached_tokens = (
            handoff.num_cached_tokens
            if handoff
            else min(chunk.num_cached_tokens, usage.prompt_tokens)
        )

    def _end_prefill(self, run: _Run, cached: int) -> None:
        """The prompt's counts on the prefill phase's span, which ends; decode's starts."""
        mig = run.a.migration
        # A migrated request's replayed output is recomputed like prompt.
        computed = run.usage.prompt_tokens + (len(mig.output_token_ids) if mig else 0)
        self.count_prompt(computed, cached)
        run.phase.set_attribute("strait.prompt_tokens", run.usage.prompt_tokens)
        run.phase.set_attribute("strait.cached_tokens", cached)
        run.phase.set_attribute("strait.computed_tokens", computed - cached)
        run.phase.end()
        run.phase = self._tracer.start_span("decode", context=run.phase_ctx)

    def _close(self, run: _Run, status: str, error_code: str) -> None:
        """The request's spans ended with its counts, and its log line (``Worker.finish``)."""
        usage, span, spec, ttft = run.usage, run.span, run.spec, run.ttft
        run.phase.set_attribute("strait.completion_tokens", usage.completion_tokens)
        run.phase.end()
        span.set_attribute("strait.prompt_tokens", usage.prompt_tokens)
        span.set_attribute("strait.completion_tokens", usage.completion_tokens)
        span.set_attribute("strait.cached_tokens", usage.cached_tokens)
        if spec[0]:
            span.set_attribute("strait.spec_proposed_tokens", spec[0])
            span.set_attribute("strait.spec_accepted_tokens", spec[1])
        self.finish(
            run.a.request.key,
            span,
            status,
            error_code,
            run.started,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            ttft_s=round(ttft, 4) if ttft else None,
            spec_accepted=f"{spec[1]}/{spec[0]}" if spec[0] else None,
        )

    async def _prepare(self, a: Assignment, start: Start, tools: ToolSpec | None) -> PreparedPrompt:
        """The request's prompt on a thread (templating, tokenizing, grammar); a handed-off
        request's is the token ids the prefill worker computed."""
        req, h = a.request, start.handoff
        prompt = await asyncio.to_thread(
            functools.partial(
                self.backend.prepare,
                prompt=None if h else req.prompt,
                prompt_token_ids=h.prompt_token_ids if h else req.prompt_token_ids,
                messages=None if h else req.messages,
                sampling=req.sampling,
                tools=tools,
            )
        )
        prompt.lora = self.adapter_of(req.model)
        return prompt
