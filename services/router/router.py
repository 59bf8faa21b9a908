"""The router's decisions: request → pool → worker → assignment.

``Router.handle`` is called once per message pulled from the requests stream (by
``services.router.main``):

    decode + validate → decide (pool, ranked workers; no I/O) → offer to the best workers in
    turn until one accepts → record (RouteDecision event, span attributes, metrics) → ack

``decide`` picks the pool (an explicit pool or model name wins; ``auto`` is classified), spills
to another allowed pool when the chosen one has no live worker (``router.spill_over``) or every
worker in it is saturated (``router.saturation_spill``), hashes the prompt's prefix blocks the
way the pool's workers do, and ranks the pool's live workers by cost (``placement``), those of
the router's own region first (``regions``: another region's when none here can take it). Every
outcome carries a ``RouteReason``; no worker anywhere → a typed ``no_worker`` error with
``retry_after_s`` on the request's stream, unless a worker may still come to the pool
(``WorkerRegistry.returning_until``: the router has just started, or a worker of the pool was
lost without draining and is being restarted): then the request waits for one
(``decide_waiting``), still unacked in JetStream, up to ``router.worker_return_wait_s``.

A placed request is watched until its stream ends (``watch``); when its worker's beats stop
first, ``worker_lost`` places it again on another worker of its pool (code ``replaced``,
``attempt + 1``): from scratch before its first token, as a migration after (the ``Migrated``
marker on the stream, then ``Assignment.migration`` with the tokens streamed so far). With
no other worker in the pool the marker's reason is ``waiting_for_worker``: the stream pauses
until a worker beats in the pool (the lost one restarted) and continues there.

The holds before a decision are in ``holds.py`` (``Router`` inherits them). Over 500 lines
because a request's life in the router — decide, offer, record, move — is one class whose
steps share the registry, the watch and the decision slots; each step is a method here.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext

from libs.log import fields
from libs.protocol import (
    Assignment,
    AssignmentAck,
    CancelRequest,
    ErrorCode,
    ErrorMessage,
    GenerateRequest,
    Migrated,
    Migration,
    ProtocolError,
    RouteDecision,
    RouteReason,
    Subjects,
    decode,
    encode,
    validate_request,
)
from libs.registry import WorkerRegistry, WorkerView
from libs.settings import Settings
from libs.telemetry import extract_context, inject_headers, tracer
from services.deadletter import dead_letter
from services.router import metrics
from services.router.classifier import CHARS_PER_TOKEN, Classifier, build_classifier, prompt_text
from services.router.holds import Holds
from services.router.placement import CostWeights, Placement, rank
from services.router.prefix import PrefixHashers
from services.router.regions import Regions
from services.router.teams import TeamPolicy, TeamRefusal
from services.router.watch import StreamWatch, Watched

log = logging.getLogger("strait.router")

# Workers offered one decision before the router gives up with no_capacity.
MAX_OFFERS = 4


@dataclass
class PoolChoice:
    pool: str
    code: str  # explicit_pool | explicit_model | auto_small | auto_large | auto_single_pool
    score: float | None = None
    factors: list[str] = field(default_factory=list)
    # Pools the request may run in, preferred first (spill-over targets after ``pool``).
    allowed: list[str] = field(default_factory=list)


@dataclass
class Decision:
    pool: str
    code: str
    score: float | None
    factors: list[str]
    ranked: list[Placement]
    decide_s: float = 0.0
    # Disaggregated pool (the ranked workers are prefill workers): decode workers, best first.
    decode_workers: list[str] = field(default_factory=list)
    # Why the request leaves the router's region ("" while a local worker can take it) and
    # the router's view of the regions (regions.py).
    cross: str = ""
    regions: Regions | None = None

    def route(self, p: Placement) -> RouteReason:
        factors = [*self.factors, f"load={p.load_cost:.3f}", f"prefill={p.prefill_cost:.3f}"]
        crossing = self.regions.crossing(p, self.cross) if self.regions is not None else ""
        if crossing:
            factors.append(f"cross_region={p.region_cost:.3f}")
        return RouteReason(
            pool=self.pool,
            worker_id=p.worker.worker_id,
            code=self.code,
            score=self.score,
            factors=factors,
            overlap_blocks=p.overlap_blocks,
            cost=round(p.cost, 4),
            region=p.worker.beat.region,
            cross_region=crossing,
        )


@dataclass
class Rejection:
    code: ErrorCode
    message: str
    param: str | None = None
    retry_after_s: float | None = None
    # no_worker: the pools that had none (a worker coming to one of them is waited for).
    pools: list[str] = field(default_factory=list)


class Router(Holds):
    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        settings: Settings,
        registry: WorkerRegistry,
        classifier: Classifier | None = None,
        hashers: PrefixHashers | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.nc, self.js, self.settings = nc, js, settings
        self.cfg, self.fleet = settings.router, settings.fleet
        self.registry = registry
        self.classifier = classifier or build_classifier(settings)
        self.hashers = hashers or PrefixHashers(settings)
        self.subjects = Subjects.of(settings.nats)
        self.rng = rng or random.Random()
        self.weights = CostWeights(
            self.cfg.overlap_weight,
            self.cfg.load_weight,
            self.cfg.prefill_norm_tokens,
            self.cfg.tie_epsilon,
        )
        self.regions = Regions(
            settings.nats.region,
            self.cfg.cross_region_cost,
            dict(self.cfg.region_costs),
            self.cfg.saturation_load,
        )
        self._configured_models = {p.name: p.model for p in settings.pools}
        self.teams = TeamPolicy(settings)
        self.watch = StreamWatch(
            nc, self.subjects, self.cfg.max_watched, self.cfg.watch_ttl_s, self.teams.finished
        )
        self._tracer = tracer("strait.router")
        # Requests waiting for a worker to come to their pool, by pool (bounded by
        # router.max_pool_queue), and the decision slots of the service (services.router.main
        # sets them; ``handle`` holds one): a request that waits gives its slot back meanwhile,
        # so other pools' requests keep being routed.
        self.waiting: dict[str, int] = {}
        self.slots: asyncio.Semaphore | None = None
        # Requests held while every worker of their pool is full, by pool, oldest first
        # (``hold_while_full``): (token, monotonic time it was held).
        self.held: dict[str, list[tuple[object, float]]] = {}
        self.held_arrivals: dict[str, int] = {}  # by pool, since the last RouterBeat

    # ------------------------------------------------------------ pool choice

    def pool_models(self) -> dict[str, str]:
        """pool → model, configured pools first, then pools only seen in beats."""
        return self._configured_models | {
            p: m for p, m in self.registry.pool_model.items() if p not in self._configured_models
        }

    def choose_pool(self, req: GenerateRequest) -> PoolChoice | None:
        """The pool for ``req`` and the pools it may spill to; None: its model is not served."""
        models = self.pool_models()
        if req.model in models:
            same = [p for p, m in models.items() if m == models[req.model] and p != req.model]
            return PoolChoice(req.model, "explicit_pool", allowed=[req.model, *same])
        serving = [p for p, m in models.items() if m == req.model]
        if serving:
            return PoolChoice(serving[0], "explicit_model", allowed=serving)
        if req.model != "auto":
            return None
        d = self.classifier.classify(req)
        small, large = self.cfg.small_pool, self.cfg.large_pool
        rest = sorted(p for p in models if p not in (small, large))
        if small in models and large in models:
            if d.score >= self.cfg.large_threshold:
                return PoolChoice(large, "auto_large", d.score, d.factors, [large, small, *rest])
            return PoolChoice(small, "auto_small", d.score, d.factors, [small, large, *rest])
        default = self.cfg.default_pool
        first = default if default in models else sorted(models)[0]
        others = [p for p in sorted(models) if p != first]
        return PoolChoice(first, "auto_single_pool", d.score, d.factors, [first, *others])

    # ------------------------------------------------------------ the decision

    def decide(
        self,
        req: GenerateRequest,
        exclude: frozenset[str] = frozenset(),
        pool: str = "",
        since: float = math.inf,
    ) -> Decision | Rejection:
        """Pool and ranked workers for ``req`` (no I/O; timed as the routing overhead).
        ``pool``: only this pool (a migration continues on the same model and format).
        ``exclude``: workers not to use, unless they (re)joined after ``since`` (a lost worker
        that was restarted is a new one)."""
        t0 = time.perf_counter()
        choice = PoolChoice(pool, "migrated", allowed=[pool]) if pool else self.choose_pool(req)
        if choice is None:
            return Rejection("model_not_found", f"model {req.model!r} is not served here", "model")
        now = time.monotonic()
        live = {p: self._live(p, exclude, since, now) for p in choice.allowed}
        pool, code, factors = choice.pool, choice.code, list(choice.factors)
        workers = live[pool]
        spill = [p for p in choice.allowed[1:] if live[p]]
        if not workers:
            if not (self.cfg.spill_over and spill):
                return Rejection(
                    "no_worker",
                    f"no live worker in pool {pool!r}"
                    + ("" if self.cfg.spill_over else " (router.spill_over is off)"),
                    retry_after_s=self.fleet.retry_after_s,
                    pools=list(choice.allowed),
                )
            factors.append(f"no_live_worker:{pool}")
            pool, code = spill[0], "spill_over"
        elif self.cfg.saturation_spill and _min_load(workers) >= self.cfg.saturation_load:
            roomy = [p for p in spill if _min_load(live[p]) < self.cfg.saturation_load]
            if roomy:
                factors.append(f"saturated:{pool}")
                pool, code = roomy[0], "spill_saturated"
        workers = live[pool]
        queue = sum([w.beat.waiting + len(w.pending_at) for w in workers])
        queue += len(self.held.get(pool, ()))
        if queue >= self.cfg.max_pool_queue:
            return Rejection(
                "no_capacity",
                f"pool {pool!r} has {queue} queued requests (router.max_pool_queue="
                f"{self.cfg.max_pool_queue})",
                retry_after_s=self.fleet.retry_after_s,
            )
        first = workers[0].beat
        hashes, n_tokens = self.prefix(
            req, pool, first.model, first.model_id or first.model, first.block_size
        )
        overlaps = self.registry.overlaps(hashes) if hashes else {}
        ranked, cross = self.regions.rank(
            workers, n_tokens, overlaps, self.weights, self.rng, MAX_OFFERS
        )
        decode_workers: list[str] = []
        if ranked[0].worker.beat.role == "prefill":
            # Decode workers hold no prompt yet: ranked by load alone (ties at random), those
            # of the prefill worker's region first (the KV blocks cross no gateway).
            decoders = [
                w
                for w in self.registry.live(pool, roles=("decode",), now=now)
                if not _excluded(w, exclude, since)
            ]
            if not decoders:
                return Rejection(
                    "no_worker",
                    f"no live decode worker in pool {pool!r}",
                    retry_after_s=self.fleet.retry_after_s,
                    pools=[pool],
                )
            home = ranked[0].worker.beat.region
            away = {w.worker_id: self.regions.cross_cost for w in decoders if w.beat.region != home}
            by_load = rank(decoders, 0, {}, self.weights, self.rng, MAX_OFFERS, away)
            decode_workers = [p.worker.worker_id for p in by_load]
        return Decision(
            pool,
            code,
            choice.score,
            factors,
            ranked,
            time.perf_counter() - t0,
            decode_workers,
            cross,
            self.regions,
        )

    def prefix(
        self, req: GenerateRequest, pool: str, model: str, model_id: str, block_size: int
    ) -> tuple[list[int], int]:
        """The prompt's block chain hashes for ``pool`` (under the workers' ``model_id``, the
        model name plus its weights' format) and its length in tokens (estimated from
        characters when the pool's tokenizer is unknown)."""
        ids = self.hashers.hasher(pool, model).token_ids(req)
        if ids is None:
            return [], len(prompt_text(req)) // CHARS_PER_TOKEN
        return self.hashers.chain(ids, block_size, model_id), len(ids)

    def _live(
        self, pool: str, exclude: frozenset[str], since: float, now: float
    ) -> list[WorkerView]:
        return [w for w in self.registry.live(pool, now=now) if not _excluded(w, exclude, since)]

    def worker_coming(self, decision: Decision | Rejection) -> bool:
        """``decision`` found no worker, and one may still come (``returning_until``)."""
        return (
            isinstance(decision, Rejection)
            and decision.code == "no_worker"
            and self.registry.returning_until(decision.pools) > 0
        )

    async def decide_waiting(
        self,
        req: GenerateRequest,
        exclude: frozenset[str] = frozenset(),
        pool: str = "",
        since: float = math.inf,
        keepalive: Callable[[], Awaitable[None]] | None = None,
        held: asyncio.Semaphore | None = None,
    ) -> Decision | Rejection:
        """``decide``; while it finds no worker where one may still come, wait for one (decided
        again every ``router.sweep_interval_s``). ``keepalive`` runs every
        ``router.assign_timeout_s`` meanwhile (JetStream's in-progress: the ack wait is four
        of those and more, so the request is not delivered again while it waits); ``held``,
        a slot the caller holds, is given back for the wait."""
        decision = self.decide(req, exclude, pool, since)
        if not self.worker_coming(decision):
            return decision
        assert isinstance(decision, Rejection)
        key = decision.pools[0]
        if self.waiting.get(key, 0) >= self.cfg.max_pool_queue:
            return Rejection(
                "no_capacity",
                f"{self.waiting[key]} requests already wait for a worker in pool {key!r} "
                f"(router.max_pool_queue={self.cfg.max_pool_queue})",
                retry_after_s=self.fleet.retry_after_s,
            )
        t0 = last_keepalive = time.monotonic()
        self.waiting[key] = self.waiting.get(key, 0) + 1
        metrics.WAITING.labels(pool=key).inc()
        log.info(
            "waiting for a worker",
            extra=fields(request_id=req.request_id, pools=decision.pools),
        )
        if held is not None:
            held.release()
        try:
            while self.worker_coming(decision):
                await asyncio.sleep(self.cfg.sweep_interval_s)
                decision = self.decide(req, exclude, pool, since)
                now = time.monotonic()
                if keepalive is not None and now - last_keepalive >= self.cfg.assign_timeout_s:
                    last_keepalive = now
                    await keepalive()
        finally:
            self.waiting[key] -= 1
            metrics.WAITING.labels(pool=key).dec()
            if held is not None:
                await held.acquire()
        waited = time.monotonic() - t0
        metrics.WAIT_SECONDS.observe(waited)
        if isinstance(decision, Rejection) and decision.code == "no_worker":
            decision.message += (
                f" (waited {waited:.1f} s for one to come back; router.worker_return_wait_s)"
            )
        return decision

    # ------------------------------------------------------------ one message

    async def handle(self, msg: Msg) -> None:
        """Route one request message; always acks it (errors are answered, not redelivered)."""
        try:
            req = self.teams.attribute(decode(msg.data, GenerateRequest), msg.subject)
            validate_request(req)
        except ProtocolError as e:
            await self._reject_malformed(msg, e)
            await msg.ack()
            return
        except Exception as e:  # a validation bug must not leave a message redelivered forever
            log.exception("request could not be validated")
            await dead_letter(self.nc, self.subjects, msg, repr(e), "router")
            await msg.ack()
            return
        ctx = extract_context(msg.headers)
        if msg.metadata.num_delivered > 1:
            # A router died holding it (or took past the ack wait): placed at most once more,
            # unless that router had a worker's acceptance and died before its ack (ms).
            metrics.REDELIVERED.inc()
            log.warning(
                "request redelivered",
                extra=fields(request_id=req.request_id, deliveries=msg.metadata.num_delivered),
            )
        admitted = self.teams.admit(req)
        if isinstance(admitted, TeamRefusal):
            refusal = Rejection(admitted.code, admitted.message, None, admitted.retry_after_s)
            await self.reply_error(req, refusal)
            await msg.ack()
            return
        acked = False

        async def ack() -> None:
            nonlocal acked
            if not acked:
                acked = True
                await msg.ack()

        with self._tracer.start_as_current_span(
            "router.route", context=ctx, attributes={"strait.request_id": req.request_id}
        ) as span:
            route = await self.place(
                req, on_accepted=ack, keepalive=msg.in_progress, held=self.slots
            )
            if route is not None:
                span.set_attributes(_span_attributes(route))
        await ack()

    async def place(
        self,
        req: GenerateRequest,
        attempt: int = 1,
        exclude: frozenset[str] = frozenset(),
        migration: Migration | None = None,
        pool: str = "",
        on_accepted: Callable[[], Awaitable[None]] | None = None,
        since: float = math.inf,
        keepalive: Callable[[], Awaitable[None]] | None = None,
        held: asyncio.Semaphore | None = None,
        recheck: bool = False,
    ) -> RouteReason | None:
        """Decide (waiting for a worker that is coming), then offer ``req`` to the ranked
        workers until one accepts. ``on_accepted`` runs the moment one does (``handle`` acks
        the JetStream message there, so a router that dies after the placement does not have
        it redelivered); ``keepalive`` and ``held`` for a wait (``decide_waiting``, and a batch
        request's ``hold_batch``)."""
        if attempt == 1 and req.priority == "batch":
            await self.hold_batch(req, keepalive, held)
        held_s = None
        if attempt == 1 and req.priority != "batch" and migration is None and not pool:
            held_s = await self.hold_while_full(req, keepalive, held)
        t_decide = time.monotonic()
        decision = await self.decide_waiting(req, exclude, pool, since, keepalive, held)
        # It waited for a worker to come (or come back): the ones it found are new arrivals,
        # whose first offers may find no route to them yet (a NATS gateway link just back).
        waited = time.monotonic() - t_decide > self.cfg.sweep_interval_s
        if isinstance(decision, Rejection):
            if attempt > 1 and decision.code == "no_worker":
                # Moving a lost worker's request: say what happened, not just what is missing.
                lost = ", ".join(sorted(exclude))
                decision.code = "worker_lost"
                decision.message = f"worker {lost} was lost and {decision.message}"
            await self.reply_error(req, decision)
            return None
        if attempt > 1:
            decision.code = "migrated" if migration is not None else "replaced"
            decision.factors += [f"worker_lost:{w}" for w in sorted(exclude)]
        if held_s is not None:
            decision.factors.append(f"held:{held_s:.2f}")
        queued_s = max(time.time() - req.created_at, 0.0)
        if attempt == 1:
            metrics.QUEUE_SECONDS.observe(queued_s)
        # NOTE: count the assignment before the first await: decisions of concurrent requests
        # interleave at every await, and must see each other's choices or they all herd onto
        # the worker that looked idlest in the last beat.
        reserved = self.registry.on_assigned(decision.ranked[0].worker.worker_id)
        watched = self.fleet.replace_lost and await self.watch.watch(req)
        silent = []  # offered workers that did not answer at all (dead, not yet expired?)
        for i, p in enumerate(decision.ranked[:MAX_OFFERS]):
            route = decision.route(p)
            if i > 0:
                reserved = self.registry.on_assigned(route.worker_id)
            answer = await self.offer(
                req, route, attempt, queued_s, decision.decode_workers, migration
            )
            if answer:
                if on_accepted is not None:
                    await on_accepted()
                if watched:
                    self.watch.assigned(req.key, route, attempt, bool(decision.decode_workers))
                await self.record(req, route, decision.decide_s)
                return route
            self.registry.on_refused(route.worker_id, reserved)
            if answer is None:
                silent.append(route.worker_id)
        everyone_silent = silent and len(silent) == min(len(decision.ranked), MAX_OFFERS)
        if everyone_silent and (not recheck or waited):
            # Nobody answered: the workers may have died inside their beat TTL (a kill -9 a
            # moment ago). One TTL later they have beaten again, or expired, which makes the
            # pool "coming back" when they left without draining: decide again then, and
            # wait for the restarted worker like any request of that pool. (Once per wait:
            # workers that came after one get their own recheck.)
            await asyncio.sleep(self.fleet.worker_ttl_s + self.cfg.sweep_interval_s)
            return await self.place(
                req,
                attempt,
                exclude,
                migration,
                pool,
                on_accepted,
                since,
                keepalive,
                held,
                recheck=True,
            )
        await self.reply_error(
            req,
            Rejection(
                "no_capacity",
                f"no worker in pool {decision.pool!r} accepted the request",
                retry_after_s=self.fleet.retry_after_s,
            ),
        )
        return None

    async def worker_lost(self, worker_id: str) -> None:
        """``worker_id`` stopped beating: move each request it held to another worker."""
        for w in self.watch.on_worker_lost(worker_id):
            if self.watch.streamed_unannounced(w):
                continue
            await self.move(w, worker_id)

    async def stalled_streams(self) -> None:
        """Move requests whose stream went silent past ``router.stall_timeout_s`` although
        their worker still beats (a hung engine thread, a wedged request)."""
        if self.cfg.stall_timeout_s <= 0:
            return
        for w in self.watch.stalled(self.cfg.stall_timeout_s):
            if not w.complete:  # its end was probably missed in a reconnect
                await self.watch.forget(w.req.key)
                continue
            if w.route is None or self.watch.streamed_unannounced(w):
                continue
            worker_id = w.route.worker_id
            w.lost.add(worker_id)
            log.warning(
                "stream stalled; moving the request",
                extra=fields(request_id=w.req.request_id, worker_id=worker_id),
            )
            await self.move(w, worker_id, reason="stalled")

    async def move(self, w: Watched, worker_id: str, reason: str = "worker_lost") -> None:
        """Place ``w`` again: from scratch before its first token, else as a migration."""
        rid = w.req.request_id
        refusal = ""
        if w.attempt >= self.cfg.max_attempts:
            refusal = f"{w.attempt} attempts (router.max_attempts)"
        elif w.streamed and w.req.sampling.n > 1:
            refusal = "requests with n > 1 do not migrate"
        elif w.streamed and not w.complete:
            refusal = "the router missed part of its stream in a NATS reconnect"
        if refusal:
            when = "mid-stream" if w.streamed else "before the first token"
            what = "stalled" if reason == "stalled" else "was lost"
            await self.reply_error(
                w.req,
                Rejection(
                    "worker_lost",
                    f"worker {worker_id!r} {what} {when}; {refusal}",
                    retry_after_s=self.fleet.retry_after_s,
                ),
            )
            return
        migration = None
        # Workers that (re)join from now on may take it, the restarted lost one included.
        since = time.monotonic()
        pool = w.route.pool if w.route is not None and w.streamed else ""
        if w.streamed:
            migration = w.migration(worker_id)
            if self.worker_coming(self.decide(w.req, frozenset(w.lost), pool, since)):
                reason = "waiting_for_worker"  # the stream pauses until a worker comes
            marker = Migrated(
                seq=w.last_seq + 1,
                request_id=rid,
                from_worker=worker_id,
                attempt=w.attempt + 1,
                num_tokens=len(w.tokens),
                reason=reason,
            )
            w.last_seq += 1
            await self.nc.publish(self.stream_subject(w.req), encode(marker))
            metrics.MIGRATED.inc()
        else:
            metrics.REPLACED.inc()
        # A worker that was only stalled must not resume a request it no longer owns.
        cancel = CancelRequest(request_id=rid, reason="moved", worker_id=worker_id)
        await self.nc.publish(self.subjects.cancel_key(w.req.key), encode(cancel))
        log.info(
            "migrating request of a lost worker" if migration else "re-placing request",
            extra=fields(
                request_id=rid,
                worker_id=worker_id,
                attempt=w.attempt + 1,
                tokens=len(w.tokens) if migration else None,
            ),
        )
        with self._tracer.start_span(
            "router.migrate" if migration else "router.replace",
            attributes={"strait.request_id": rid},
        ) as span:
            route = await self.place(
                w.req, w.attempt + 1, frozenset(w.lost), migration, pool, since=since
            )
            if route is not None:
                span.set_attributes(_span_attributes(route))

    def stream_subject(self, req: GenerateRequest) -> str:
        return req.reply_subject or self.subjects.stream(req.request_id)

    async def offer(
        self,
        req: GenerateRequest,
        route: RouteReason,
        attempt: int,
        queued_s: float,
        decode_workers: list[str] | None = None,
        migration: Migration | None = None,
    ) -> bool | None:
        """Offer ``req`` to one worker: True it accepted, False it refused, None no answer
        within ``router.assign_timeout_s`` (or no one listens on its subject)."""
        a = Assignment(
            request=req,
            route=route,
            attempt=attempt,
            queued_s=queued_s,
            decode_workers=decode_workers or [],
            migration=migration,
        )
        try:
            reply = await self.nc.request(
                self.subjects.work(route.worker_id),
                encode(a),
                timeout=self.cfg.assign_timeout_s,
                headers=inject_headers(),
            )
        except (NatsTimeout, NoRespondersError, TimeoutError):
            log.warning(
                "worker did not answer",
                extra=fields(request_id=req.request_id, worker_id=route.worker_id),
            )
            return None
        try:
            ack = msgspec.json.decode(reply.data, type=AssignmentAck)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False
        return ack.accepted

    async def record(self, req: GenerateRequest, route: RouteReason, decision_s: float) -> None:
        """The decision's reason in metrics, the events stream and the log."""
        metrics.DECISIONS.labels(pool=route.pool, reason=route.code).inc()
        metrics.DECISION_SECONDS.observe(decision_s)
        metrics.OVERLAP_BLOCKS.observe(route.overlap_blocks)
        if route.cross_region:
            metrics.CROSS_REGION.labels(region=route.region, reason=route.cross_region).inc()
        ev = RouteDecision(
            request_id=req.request_id, origin=req.origin, route=route, decision_s=decision_s
        )
        try:
            await self.js.publish(self.subjects.event("route"), encode(ev), timeout=1.0)
        except Exception as e:  # the event stream is for observers; never block routing on it
            log.warning("route event publish failed", extra=fields(error=repr(e)))
        log.info(
            "routed",
            extra=fields(
                request_id=req.key,
                pool=route.pool,
                worker_id=route.worker_id,
                reason=route.code,
                score=route.score,
                factors=route.factors,
                overlap_blocks=route.overlap_blocks,
                cost=route.cost,
                region=route.region or None,
                cross_region=route.cross_region or None,
                decision_ms=round(decision_s * 1000, 3),
            ),
        )

    async def reply_error(self, req: GenerateRequest, r: Rejection) -> None:
        """End ``req``'s stream with a typed error (after whatever it already carried)."""
        metrics.REJECTED.labels(code=r.code).inc()
        log.info("rejected", extra=fields(request_id=req.request_id, code=r.code, error=r.message))
        seq = self.watch.next_seq(req.key)
        await self.watch.forget(req.key)
        err = ErrorMessage(
            seq=seq,
            request_id=req.request_id,
            code=r.code,
            message=r.message,
            param=r.param,
            retry_after_s=r.retry_after_s,
        )
        await self.nc.publish(self.stream_subject(req), encode(err))

    async def _reject_malformed(self, msg: Msg, e: ProtocolError) -> None:
        metrics.REJECTED.labels(code=e.code).inc()
        if e.request_id:  # usable as a subject token (ProtocolError keeps no other)
            err = ErrorMessage(seq=1, request_id=e.request_id, code=e.code, message=str(e))
            team = self.teams.sender(msg.subject)
            subject = (
                self.subjects.stream(e.request_id)
                if team is None
                else self.subjects.team_stream(team, e.request_id)
            )
            await self.nc.publish(subject, encode(err))
        else:
            await dead_letter(self.nc, self.subjects, msg, str(e), "router")


def _excluded(w: WorkerView, exclude: frozenset[str], since: float) -> bool:
    return w.worker_id in exclude and w.joined_at <= since


def _min_load(workers: list[WorkerView]) -> float:
    return min((w.load for w in workers), default=float("inf"))


def _span_attributes(route: RouteReason) -> dict[str, str | int | float | list[str]]:
    attrs: dict[str, str | int | float | list[str]] = {
        "strait.pool": route.pool,
        "strait.worker_id": route.worker_id,
        "strait.route_reason": route.code,
        "strait.route_factors": route.factors,
        "strait.overlap_blocks": route.overlap_blocks,
    }
    if route.region:
        attrs["strait.region"] = route.region
    if route.cross_region:
        attrs["strait.cross_region"] = route.cross_region
    if route.score is not None:
        attrs["strait.difficulty"] = route.score
    if route.cost is not None:
        attrs["strait.route_cost"] = route.cost
    return attrs
