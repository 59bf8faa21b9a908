"""What every worker does, whatever its role: take assignments, cancels, resends and team
revocations over NATS, own its requests' streams, beat its load, drain.

Subclassed by each role (``strait worker`` runs the entry of ``worker.role``'s package):
``AggregatedWorker`` (aggregated.py: prompt and tokens here), ``DecodeWorker``
(services/decode/worker.py: tokens after a KV handoff) and ``PrefillWorker``
(services/prefill/worker.py: prompt and first token, then a handoff).
Flow per assignment: router --Assignment (request/reply)--> ``on_assignment`` → ack → the role's
``serve`` task → TokenDelta… → Finished (or ErrorMessage, through :meth:`Worker.fail`), and
:meth:`Worker.finish` logs it. A ``CancelRequest`` aborts the request and frees its blocks.
Each finished request's usage event for the ledger: ``usage.py``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Coroutine
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.context import Context

from libs.backend import Backend, BackendError, GenerationChunk
from libs.log import fields
from libs.protocol import (
    AdapterCommand,
    AdapterReply,
    Assignment,
    AssignmentAck,
    CancelRequest,
    ErrorMessage,
    Finished,
    GenerateRequest,
    KvEvent,
    ProtocolError,
    ResendRequest,
    Subjects,
    TeamsChanged,
    Timings,
    TokenDelta,
    ToolCall,
    Usage,
    WorkerBeat,
    encode,
    request_key,
    validate_request,
)
from libs.settings import Settings
from libs.telemetry import extract_context, tracer
from libs.wire.nats_util import publish_msg
from libs.wire.stream_writer import StreamTaken, StreamWriter
from services.deadletter import dead_letter
from services.endpoint import Endpoint, dead_letters
from services.worker import metrics
from services.worker.adapters import adapter_of
from services.worker.usage import UsageReporter, usage_event

log = logging.getLogger("strait.worker")

# Request keys of recent cancels a worker remembers (a cancel can overtake a handoff's commit).
RECENT_CANCELS = 4096


def default_worker_id(pool: str) -> str:
    return f"{pool}-{socket.gethostname().split('.')[0]}-{os.getpid()}"


class Worker:
    def __init__(self, nc: NATS, settings: Settings, backend: Backend, worker_id: str = "") -> None:
        self.nc = nc
        self.settings = settings
        self.backend = backend
        metrics.configure_tenant_labels(settings.flow.max_tenant_labels)
        self.pool = settings.worker.pool
        self.role = settings.worker.role
        self.worker_id = worker_id or settings.worker.worker_id or default_worker_id(self.pool)
        self.subjects = Subjects.of(settings.nats)
        # Every map of requests is keyed by GenerateRequest.key, (origin, id): two teams may
        # run requests of the same id here at once.
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.draining = False
        self._tracer = tracer("strait.worker")
        self.log = log
        # Cancels seen (bounded): a handoff committed after its request's cancel is refused.
        self.recently_cancelled: OrderedDict[str, None] = OrderedDict()
        # Running request → its team (GenerateRequest.team), for revocations.
        self.teams: dict[str, str | None] = {}
        # Prompt tokens this worker computed / served from its prefix cache (tests, beats).
        self.prompt_tokens_computed = 0
        self.prompt_tokens_cached = 0
        self.usage = UsageReporter(nc, self.subjects, settings.worker)
        # Stream writers of running requests, and of ended ones for worker.resend_keep_s
        # (request id → writer, end time), for ResendRequests.
        self.writers: dict[str, StreamWriter] = {}
        self.ended_writers: OrderedDict[str, tuple[StreamWriter, float]] = OrderedDict()
        # When this worker last published a beat (monotonic; 0 before the first). Past the
        # router's worker_ttl_s without one, the router presumes it lost and moves its requests.
        self.last_beat_at = 0.0

    def owns_streams(self) -> bool:
        """False once the router must have presumed this worker lost (no beat sent within
        ``fleet.worker_ttl_s``: a SIGSTOP, a stalled event loop): its requests run elsewhere
        now, and their streams are not this worker's to write. Asked before every publish."""
        if not self.last_beat_at:
            return True
        return time.monotonic() - self.last_beat_at <= self.settings.fleet.worker_ttl_s

    # ------------------------------------------------------------ NATS endpoints

    def endpoints(self) -> list[tuple[str, Endpoint[Any]]]:
        """(subject, handler) of everything a worker of any role serves; ``services.worker.process``
        subscribes them (and a decode worker's handoff subjects, ``HandoffReceiver``)."""
        nc, subjects, wid = self.nc, self.subjects, self.worker_id
        letters = dead_letters(nc, subjects, "worker")
        return [
            (
                subjects.work(wid),
                Endpoint(
                    "worker.assignment",
                    Assignment,
                    self.on_assignment,
                    self._reject_malformed,
                    validate=lambda a: validate_request(a.request),
                ),
            ),
            (
                subjects.cancel_all,
                Endpoint("worker.cancel", CancelRequest, self.on_cancel, letters),
            ),
            (
                subjects.resend_all,
                Endpoint("worker.resend", ResendRequest, self.on_resend, letters),
            ),
            (
                subjects.teams_changed,
                Endpoint("worker.teams_changed", TeamsChanged, self.on_teams_changed, letters),
            ),
            (
                subjects.adapters(self.pool),
                Endpoint("worker.adapters", AdapterCommand, self.on_adapters, letters),
            ),
        ]

    def refusal(self, a: Assignment) -> str:
        """Why this worker does not take ``a`` now ("" = it does): draining, or full (running
        and queued past ``worker.max_waiting`` + the engine's capacity)."""
        if self.draining:
            return "draining"
        if len(self.tasks) >= self.settings.worker.max_waiting + self.load_capacity():
            return "full"
        return ""

    async def on_assignment(self, a: Assignment, msg: Msg) -> AssignmentAck | None:
        """The router offers ``a``: accept it (and start :meth:`serve`) or say why not."""
        reason = self.refusal(a)
        if reason:
            return AssignmentAck(accepted=False, reason=reason)
        if a.request.key in self.tasks:  # duplicate delivery of an assignment we already run
            return AssignmentAck(accepted=True, reason="duplicate")
        # Acknowledged before the request starts (the router waits on it, not on the work).
        await self._ack(msg, AssignmentAck(accepted=True))
        self.start_task(a.request, self.serve(a, extract_context(msg.headers)))
        return None

    async def serve(self, a: Assignment, parent: Context) -> None:
        """Run one assigned request to the end of its stream (each role's own)."""
        raise NotImplementedError

    def start_task(
        self, req: GenerateRequest, coro: Coroutine[Any, Any, None]
    ) -> asyncio.Task[None]:
        """Run ``coro`` as ``req``'s task (``tasks``), remembering its team until it ends."""
        key = req.key
        task = asyncio.create_task(coro)
        self.tasks[key], self.teams[key] = task, req.team

        def done(t: asyncio.Task[None]) -> None:
            if self.tasks.get(key) in (None, t):
                self.teams.pop(key, None)

        task.add_done_callback(done)
        return task

    async def on_cancel(self, c: CancelRequest, msg: Msg) -> None:
        try:
            team, rid = self.subjects.addressed(msg.subject, "cancel", c.request_id)
        except ValueError:
            await dead_letter(self.nc, self.subjects, msg, "not a cancel subject", "worker")
            return
        if c.worker_id and c.worker_id != self.worker_id:
            return  # the request was taken from another worker, and runs here now
        # A team's cancel (cancel.<team>.<id>) names that team's request and no other.
        key = request_key(team, rid)
        self.recently_cancelled[key] = None
        while len(self.recently_cancelled) > RECENT_CANCELS:
            self.recently_cancelled.popitem(last=False)
        self._cancel(key)

    def _cancel(self, key: str) -> None:
        task = self.tasks.get(key)
        if task is not None:
            self.backend.abort(key)
            task.cancel()
            metrics.CANCELLED.inc()

    async def on_adapters(self, cmd: AdapterCommand, msg: Msg) -> AdapterReply:
        """``strait adapters``: load, unload or list this worker's LoRA adapters (on the
        engine thread, between steps; an unloaded one's running requests finish first)."""
        control = getattr(self.backend, "adapters", None)
        reply = AdapterReply(worker_id=self.worker_id)
        if control is None:
            reply.ok, reply.error = False, "this worker's backend serves no LoRA adapters"
            reply.code = "invalid_request"
            return reply
        try:
            reply.loaded = await control(cmd.action, cmd.name, cmd.path)
        except KeyError:
            reply.ok, reply.error = False, f"adapter {cmd.name!r} not found"
            reply.code = "model_not_found"
        except Exception as e:  # refused (AdapterError), no slots (BackendError): said back
            reply.ok, reply.error = False, str(e)
            # AdapterError is a ValueError; BackendError and NoFreeSlot carry their code.
            refused = "invalid_request" if isinstance(e, ValueError) else "internal_error"
            reply.code = getattr(e, "code", refused)
        if not reply.ok:
            reply.loaded = await control("list")
        log.info(
            "adapters",
            extra=fields(action=cmd.action, adapter=cmd.name, ok=reply.ok, error=reply.error),
        )
        return reply

    async def on_teams_changed(self, tc: TeamsChanged, msg: Msg) -> None:
        """``strait teams revoke``: cancel the running requests of revoked teams."""
        revoked = set(tc.revoked)
        for key in [k for k, t in self.teams.items() if t in revoked]:
            log.info("cancelling a revoked team's request", extra=fields(request_id=key))
            self._cancel(key)

    async def on_resend(self, r: ResendRequest, msg: Msg) -> None:
        """A reader lost stream messages: publish again what this worker still holds."""
        try:
            team, rid = self.subjects.addressed(msg.subject, "resend")
        except ValueError:
            return
        # A team's resend (resend.<team>.<id>) names that team's stream and no other.
        key = request_key(team, rid)
        held = self.writers.get(key) or self.ended_writers.get(key, (None, 0.0))[0]
        if held is not None:
            n = await held.resend(r.from_seq)
            metrics.RESENT.inc(n)
            log.info("resent", extra=fields(request_id=rid, from_seq=r.from_seq, messages=n))

    def _keep_ended(self, key: str) -> None:
        """Keep an ended request's writer for ``worker.resend_keep_s`` (bounded by age)."""
        out = self.writers.pop(key, None)
        now = time.monotonic()
        keep_s = self.settings.worker.resend_keep_s
        if out is not None and out.sent and keep_s > 0:
            self.ended_writers[key] = (out, now)
        while self.ended_writers:
            _, (_, ended) = next(iter(self.ended_writers.items()))
            if now - ended <= keep_s:
                break
            self.ended_writers.popitem(last=False)

    async def _ack(self, msg: Msg, ack: AssignmentAck) -> None:
        if msg.reply:
            await self.nc.publish(msg.reply, encode(ack))

    async def _reject_malformed(self, msg: Msg, e: ProtocolError) -> None:
        """Answer a bad assignment on the request's stream when we can tell where it goes."""
        if msg.reply:
            await self.nc.publish(msg.reply, encode(AssignmentAck(accepted=False, reason=str(e))))
        if e.request_id:
            err = ErrorMessage(seq=1, request_id=e.request_id, code=e.code, message=str(e))
            await self.nc.publish(self.subjects.stream(e.request_id), encode(err))
        else:
            await dead_letter(self.nc, self.subjects, msg, str(e), "worker")

    async def send_chunk(
        self, out: StreamWriter, chunk: GenerationChunk, tool_calls: list[ToolCall] | None = None
    ) -> None:
        """One TokenDelta; ``tool_calls`` (on a choice's last chunk) turn its finish into
        ``tool_calls``."""
        await out.send(
            TokenDelta(
                seq=out.next_seq(),
                request_id=out.request_id,
                index=chunk.index,
                text=chunk.text,
                token_ids=chunk.token_ids,
                logprobs=chunk.logprobs,
                finish_reason="tool_calls" if tool_calls else chunk.finish_reason,
                tool_calls=tool_calls or None,
            )
        )

    async def send_finished(
        self, out: StreamWriter, a: Assignment, usage: Usage, ttft: float | None, total: float
    ) -> None:
        """The stream's last message; ``total``: seconds from assignment to the last token."""
        await out.send(
            Finished(
                seq=out.next_seq(),
                request_id=out.request_id,
                usage=usage,
                model=self.backend.model_name,
                pool=self.pool,
                worker_id=self.worker_id,
                timings=Timings(queued_s=a.queued_s, ttft_s=ttft, total_s=total),
            )
        )
        metrics.OUTPUT_TOKENS.inc(usage.completion_tokens)
        metrics.E2E.observe(total)
        if self.settings.worker.report_usage:
            self.usage.report(
                usage_event(
                    a,
                    out.request_id,
                    usage,
                    ttft,
                    total,
                    pool=self.pool,
                    model=self.backend.model_name,
                    worker_id=self.worker_id,
                )
            )

    async def flush_usage(self, timeout_s: float) -> None:
        """Wait for usage events still being published (before the connection closes)."""
        await self.usage.flush(timeout_s)

    async def fail(self, out: StreamWriter, e: BaseException) -> tuple[str, str]:
        """End a request's stream after ``e``: (status, error code) for the log and metrics.
        A cancel (client or shutdown) frees the request's blocks; only a shutdown tells the
        client, since a cancelling client is gone."""
        rid = out.request_id
        if isinstance(e, StreamTaken):
            self.backend.abort(out.key)
            return "moved", "presumed_lost"
        if isinstance(e, asyncio.CancelledError):
            self.backend.abort(out.key)
            if self.draining and not self.migrates_on_drain():
                await out.send(
                    ErrorMessage(
                        seq=out.next_seq(),
                        request_id=rid,
                        code="worker_lost",
                        message=f"{self.role} worker shut down before the request finished",
                        retry_after_s=1.0,
                    )
                )
            return "cancelled", "cancelled"
        if isinstance(e, BackendError):
            err = ErrorMessage(
                seq=out.next_seq(),
                request_id=rid,
                code=e.code,
                message=str(e),
                param=e.param,
                retry_after_s=e.retry_after_s,
            )
        else:
            log.exception("request failed", extra=fields(request_id=rid), exc_info=e)
            err = ErrorMessage(
                seq=out.next_seq(),
                request_id=rid,
                code="internal_error",
                message=f"{self.role} worker error: {e}",
            )
        await out.send(err)
        return "error", err.code

    def count_prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens_computed += prompt_tokens - cached_tokens
        self.prompt_tokens_cached += cached_tokens
        metrics.PROMPT_TOKENS.labels(kind="computed").inc(prompt_tokens - cached_tokens)
        metrics.PROMPT_TOKENS.labels(kind="cached").inc(cached_tokens)

    def load_capacity(self) -> int:
        return self.backend.load().capacity

    # ------------------------------------------------------------ one request

    def adapter_of(self, model: str) -> str:
        """The LoRA adapter a request for ``model`` runs with here ("": the base model)."""
        names = (self.backend.model_name, self.backend.model_id)
        return adapter_of(model, self.pool, names)

    def begin(self, span_name: str, a: Assignment, parent: Context) -> trace.Span:
        """A request's start: running and queue-time metrics, and its span (ended by
        :meth:`finish`)."""
        metrics.RUNNING.inc()
        metrics.QUEUE.observe(a.queued_s)
        return self._tracer.start_span(
            span_name,
            context=parent,
            attributes={
                "strait.request_id": a.request.request_id,
                "strait.worker_id": self.worker_id,
                "strait.pool": self.pool,
            },
        )

    def finish(
        self,
        key: str,
        span: trace.Span,
        status: str,
        error_code: str,
        started: float,
        **details: object,
    ) -> None:
        """A request's end, whatever it was: metrics, span status, the one INFO log line."""
        metrics.RUNNING.dec()
        metrics.REQUESTS.labels(status=status).inc()
        self._keep_ended(key)
        if status != "ok":
            span.set_status(trace.StatusCode.ERROR, error_code)
        span.end()
        self.tasks.pop(key, None)
        self.log.info(
            "request",
            extra=fields(
                request_id=key,  # a team account's request: <team>.<id>
                status=status,
                error=error_code or None,
                pool=self.pool,
                **details,
                total_s=round(time.perf_counter() - started, 4),
            ),
        )

    # ------------------------------------------------------------ beats

    def beat(self) -> tuple[WorkerBeat, KvEvent | None]:
        load = self.backend.load()
        metrics.KV_BLOCKS_USED.set(load.kv_blocks_used)
        metrics.KV_BLOCKS_FREE.set(load.kv_blocks_free)
        metrics.WAITING.set(load.waiting)
        beat = WorkerBeat(
            worker_id=self.worker_id,
            pool=self.pool,
            role=self.role,
            model=self.backend.model_name,
            model_id=self.backend.model_id,
            running=load.running,
            waiting=load.waiting,
            kv_blocks_used=load.kv_blocks_used,
            kv_blocks_free=load.kv_blocks_free,
            capacity=load.capacity,
            block_size=load.block_size,
            max_model_len=self.backend.max_model_len,
            draining=self.draining,
            step_load=load.step_load,
            region=self.subjects.region,
            adapters=load.adapters,
            forward=load.forward,
        )
        kv = None
        if load.stored_hashes or load.evicted_hashes:
            kv = KvEvent(
                worker_id=self.worker_id,
                model=self.backend.model_id,
                stored=load.stored_hashes,
                evicted=load.evicted_hashes,
            )
        return beat, kv

    async def beat_loop(self, stopping: asyncio.Event) -> None:
        subject = self.subjects.beat(self.pool, self.role, self.worker_id)
        while True:
            if not self.owns_streams() and self.tasks:
                # Stalled past the router's TTL: it has moved these requests elsewhere.
                log.warning(
                    "beats stalled past fleet.worker_ttl_s; dropping requests moved elsewhere",
                    extra=fields(
                        worker_id=self.worker_id,
                        stalled_s=round(time.monotonic() - self.last_beat_at, 3),
                        requests=len(self.tasks),
                    ),
                )
                for rid, t in list(self.tasks.items()):
                    self.backend.abort(rid)
                    t.cancel()
            beat, kv = self.beat()
            try:
                await publish_msg(self.nc, subject, beat)
                self.last_beat_at = time.monotonic()
                if kv is not None:
                    await publish_msg(self.nc, self.subjects.kv_events(self.worker_id), kv)
            except Exception as e:  # reconnecting: the next beat will go out
                log.warning("beat failed", extra=fields(error=repr(e)))
            try:
                await asyncio.wait_for(stopping.wait(), self.settings.worker.beat_interval_s)
                return
            except TimeoutError:
                continue

    def migrates_on_drain(self) -> bool:
        """Requests still running at the drain deadline move to another worker (the router
        places them again, or migrates them, once this worker's beats stop) rather than end
        with ``worker_lost``."""
        return self.settings.fleet.replace_lost

    async def drain(self, timeout_s: float) -> None:
        """Stop taking work (beats say draining), let running requests finish for up to
        ``timeout_s``, then cancel the rest: silently where they migrate, else with a
        ``worker_lost`` error. The caller stops the beats afterwards."""
        self.draining = True
        beat, _ = self.beat()
        await publish_msg(self.nc, self.subjects.beat(self.pool, self.role, self.worker_id), beat)
        if self.tasks:
            _, pending = await asyncio.wait(list(self.tasks.values()), timeout=timeout_s)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
