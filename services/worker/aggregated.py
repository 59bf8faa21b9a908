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
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context

from libs.backend import PreparedPrompt, Resume
from libs.flow.tenant import engine_tenant, tenant_of
from libs.protocol import Assignment, HandoffOffer, Routed, Usage
from libs.stream_writer import StreamWriter
from libs.tools import ToolCallCollector, ToolSpec, constraint_kind
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


class AggregatedWorker(Worker):
    async def serve(self, a: Assignment, parent: Context) -> None:
        start = Start.fresh(a) if a.migration is None else Start.migrated(a)
        await self.generate(a, parent, start)

    async def generate(self, a: Assignment, parent: Context, start: Start) -> None:
        """Run one request to its end on the stream, from ``start``."""
        req = a.request
        rid, key = req.request_id, req.key
        handoff, mig = start.handoff, a.migration
        out = StreamWriter(
            self.nc,
            req.reply_subject or self.subjects.stream(rid),
            rid,
            start.first_seq,
            owner=self.owns_streams,
            keep=self.settings.worker.resend_window,
            key=key,
        )
        self.writers[key] = out
        started = time.perf_counter()
        # Time to first token as the client sees it from the workers' side: a handed-off
        # request already spent prefill_s on the prefill worker.
        ttft_offset = handoff.prefill_s if handoff else 0.0
        ttft: float | None = None
        last_token_at = 0.0
        spec = (0, 0)  # speculative tokens proposed and kept for this request so far
        usage = Usage()
        status, error_code = "ok", ""
        span = self.begin("worker.generate", a, parent)
        phase_ctx = trace.set_span_in_context(span)
        # Both phases run here: "prefill" until the first token, then "decode". A handed-off
        # request is in its decode phase from the start.
        phase = self._tracer.start_span("decode" if handoff else "prefill", context=phase_ctx)
        replayed = mig.output_token_ids if mig is not None else []
        if mig is not None:
            span.set_attribute("strait.migrated_from", mig.from_worker)
            span.set_attribute("strait.replayed_tokens", len(mig.output_token_ids))
        try:
            if start.echo_route:
                await out.send(Routed(seq=out.next_seq(), request_id=rid, route=a.route))
            tools = ToolSpec.of(req)
            prompt = await self._prepare(a, start, tools)
            usage.prompt_tokens = len(prompt.token_ids)
            span.set_attribute("strait.constraint", constraint_kind(req))
            calls = ToolCallCollector(tools, req.sampling.n) if tools and tools.parsed else None
            if mig is not None:
                # The lost worker's tokens count once, here; their text feeds the call parser.
                usage.completion_tokens = len(mig.output_token_ids)
                if calls is not None:
                    calls.texts[0] = mig.output_text
            if mig is not None and mig.finished and handoff is None:
                # Every delta was streamed; only the stream's end was lost with the worker.
                await self.send_finished(out, a, usage, None, time.perf_counter() - started)
                return
            tokens = self.settings.worker.batch_delta_tokens
            hold = DeltaHold(tokens) if req.priority == "batch" and tokens > 1 else None
            gen = self.backend.generate(
                key, prompt, req.sampling, req.priority, start.resume, tenant=engine_tenant(req)
            )
            async for chunk in gen:
                now = time.perf_counter()
                if ttft is None and (chunk.token_ids or chunk.finish_reason):
                    ttft = ttft_offset + now - started
                    span.add_event("first_token")
                    metrics.TTFT.labels(req.priority, metrics.tenant_label(tenant_of(req))).observe(
                        ttft
                    )
                    if handoff is None:
                        # A migrated request's replayed output is recomputed like prompt.
                        computed = usage.prompt_tokens + len(replayed)
                        self.count_prompt(computed, chunk.num_cached_tokens)
                        phase.set_attribute("strait.prompt_tokens", usage.prompt_tokens)
                        phase.set_attribute("strait.cached_tokens", chunk.num_cached_tokens)
                        phase.set_attribute(
                            "strait.computed_tokens",
                            computed - chunk.num_cached_tokens,
                        )
                        phase.end()
                        phase = self._tracer.start_span("decode", context=phase_ctx)
                elif chunk.token_ids and chunk.index == 0:
                    # A step that kept speculated tokens delivers several at once: each of
                    # them waited its share.
                    itl = metrics.ITL.labels(req.priority, metrics.tenant_label(tenant_of(req)))
                    for _ in chunk.token_ids:
                        itl.observe((now - last_token_at) / len(chunk.token_ids))
                if chunk.token_ids and chunk.index == 0:
                    last_token_at = now
                spec = (chunk.num_spec_proposed, chunk.num_spec_accepted)
                usage.completion_tokens += len(chunk.token_ids)
                usage.cached_tokens = (
                    handoff.num_cached_tokens
                    if handoff
                    else min(chunk.num_cached_tokens, usage.prompt_tokens)
                )
                found = calls.add(chunk) if calls else None
                if hold is not None:
                    held = hold.add(chunk, last=found is not None)
                    if held is None:
                        continue
                    chunk = held
                await self.send_chunk(out, chunk, found)
            total = ttft_offset + time.perf_counter() - started
            await self.send_finished(out, a, usage, ttft, total)
        except (Exception, asyncio.CancelledError) as e:
            status, error_code = await self.fail(out, e)
        finally:
            phase.set_attribute("strait.completion_tokens", usage.completion_tokens)
            phase.end()
            span.set_attribute("strait.prompt_tokens", usage.prompt_tokens)
            span.set_attribute("strait.completion_tokens", usage.completion_tokens)
            span.set_attribute("strait.cached_tokens", usage.cached_tokens)
            if spec[0]:
                span.set_attribute("strait.spec_proposed_tokens", spec[0])
                span.set_attribute("strait.spec_accepted_tokens", spec[1])
            self.finish(
                key,
                span,
                status,
                error_code,
                started,
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
