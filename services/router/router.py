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
first, ``worker_lost`` (``moves.py``) places it again on another worker of its pool (code
``replaced``, ``attempt + 1``): from scratch before its first token, as a migration after (the ``Migrated``
marker on the stream, then ``Assignment.migration`` with the tokens streamed so far). With
no other worker in the pool the marker's reason is ``waiting_for_worker``: the stream pauses
until a worker beats in the pool (the lost one restarted) and continues there.

A request's life in the router is one class whose steps share the registry, the watch and the
decision slots; its parts are mixed in from a module each: the holds before a decision
(``holds.py``), moving a request off a lost or stalled worker (``moves.py``), and what the
router sends (``replies.py``: offer, record, typed errors). The decision's types are in
``decision.py``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from libs.log import fields
from libs.models.adapters import AdapterCatalogue
from libs.protocol import (
    Finished,
    GenerateRequest,
    Migration,
    ProtocolError,
    RouteReason,
    Subjects,
    decode,
    validate_request,
)
from libs.registry import WorkerRegistry, WorkerView
from libs.settings import Settings
from libs.telemetry import extract_context, tracer
from services.deadletter import dead_letter
from services.router import metrics
from services.router.classifier import CHARS_PER_TOKEN, Classifier, build_classifier, prompt_text
from services.router.decision import (
    MAX_OFFERS,
    Decision,
    PoolChoice,
    Rejection,
    span_attributes,
)
from services.router.flow import TenantFlow
from services.router.holds import HeldRequest, Holds, Refused
from services.router.moves import Moves
from services.router.placement import CostWeights, rank
from services.router.prefix import PrefixHashers
from services.router.regions import Regions
from services.router.replies import Replies
from services.router.teams import TeamPolicy, TeamRefusal
from services.router.watch import StreamWatch

log = logging.getLogger("strait.router")


class Router(Holds, Moves, Replies):
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
        self.flow = TenantFlow(settings)
        metrics.configure_tenant_labels(settings.flow.max_tenant_labels)
        self.adapters = AdapterCatalogue(settings)  # LoRA adapter → pool
        self.watch = StreamWatch(
            nc, self.subjects, self.cfg.max_watched, self.cfg.watch_ttl_s, self.stream_ended
        )
        self._tracer = tracer("strait.router")
        # Requests waiting for a worker to come to their pool, by pool (bounded by
        # router.max_pool_queue), and the decision slots of the service (services.router.main
        # sets them; ``handle`` holds one): a request that waits gives its slot back meanwhile,
        # so other pools' requests keep being routed.
        self.waiting: dict[str, int] = {}
        self.slots: asyncio.Semaphore | None = None
        # Requests held while every worker of their pool is full, by pool, oldest first
        # (``hold_while_full``).
        self.held: dict[str, list[HeldRequest]] = {}
        self.held_arrivals: dict[str, int] = {}  # by pool, since the last RouterBeat

    def stream_ended(self, req: GenerateRequest, final: Finished | None) -> None:
        """The watch forgot ``req`` (its stream ended): its team's usage, its tenant's share."""
        self.teams.finished(req, final)
        self.flow.ended(req, final)

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
            return self.adapter_choice(req)
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

    def adapter_choice(self, req: GenerateRequest) -> PoolChoice | None:
        """The pool of the LoRA adapter ``req.model`` names (libs/models/adapters.py), None when no
        pool serves it or it is another team's (refused like an unknown model)."""
        announced = ((v.beat.pool, v.beat.adapters) for v in self.registry.workers.values())
        pool = self.adapters.all(announced).get(req.model)
        if pool is None or not self.teams.may_use(req.model, req.team):
            return None
        return PoolChoice(pool, "explicit_adapter", allowed=[pool])

    def adapter_misses(
        self, req: GenerateRequest, code: str, workers: list[WorkerView]
    ) -> dict[str, float] | None:
        """``router.adapter_miss_cost`` for each worker whose beats do not list the LoRA
        adapter ``req`` names as loaded (None: the request names none)."""
        if code != "explicit_adapter":
            return None
        cost = self.cfg.adapter_miss_cost
        return {w.worker_id: cost for w in workers if req.model not in w.beat.adapters}

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
        factors = list(choice.factors)
        spilled = self._spill(choice, live, factors)
        if isinstance(spilled, Rejection):
            return spilled
        pool, code = spilled
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
        misses = self.adapter_misses(req, code, workers)
        ranked, cross = self.regions.rank(
            workers, n_tokens, overlaps, self.weights, self.rng, MAX_OFFERS, misses
        )
        decode_workers: list[str] = []
        if ranked[0].worker.beat.role == "prefill":
            found = self._decode_workers(pool, ranked[0].worker, exclude, since, now)
            if isinstance(found, Rejection):
                return found
            decode_workers = found
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

    def _spill(
        self, choice: PoolChoice, live: dict[str, list[WorkerView]], factors: list[str]
    ) -> tuple[str, str] | Rejection:
        """(pool, reason code) ``decide`` places in: the chosen pool, or the next allowed one
        with live workers when it has none (``router.spill_over``) or all of its workers are
        saturated (``router.saturation_spill``; a factor says why). A rejection when no pool
        has a live worker."""
        pool, code = choice.pool, choice.code
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
            return spill[0], "spill_over"
        if self.cfg.saturation_spill and _min_load(workers) >= self.cfg.saturation_load:
            roomy = [p for p in spill if _min_load(live[p]) < self.cfg.saturation_load]
            if roomy:
                factors.append(f"saturated:{pool}")
                return roomy[0], "spill_saturated"
        return pool, code

    def _decode_workers(
        self,
        pool: str,
        prefill: WorkerView,
        exclude: frozenset[str],
        since: float,
        now: float,
    ) -> list[str] | Rejection:
        """The decode workers ``decide`` names for a disaggregated pool whose best worker is
        the ``prefill`` one, best first. They hold no prompt yet: ranked by load alone (ties at
        random), those of the prefill worker's region first (the KV blocks cross no
        gateway)."""
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
        home = prefill.beat.region
        away = {w.worker_id: self.regions.cross_cost for w in decoders if w.beat.region != home}
        by_load = rank(decoders, 0, {}, self.weights, self.rng, MAX_OFFERS, away)
        return [p.worker.worker_id for p in by_load]

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
                f" (waited {waited:.1f} s for one to come back; router.worker_return_wait_s,"
                " router.worker_stall_s)"
            )
        return decision

    # ------------------------------------------------------------ one message

    async def handle(self, msg: Msg) -> None:
        """Route one request message; always acks it (errors are answered, not redelivered)."""
        try:
            req = self.teams.attribute(decode(msg.data, GenerateRequest), msg.subject)
            validate_request(req)
            req = self.teams.with_terms(req)
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
                span.set_attributes(span_attributes(route))
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
        held_s = await self._wait_turn(req, attempt, migration, pool, keepalive, held)
        if isinstance(held_s, Rejection):
            await self.reply_error(req, held_s)
            return None
        self.flow.placed(req)
        t_decide = time.monotonic()
        decision = await self.decide_waiting(req, exclude, pool, since, keepalive, held)
        # It waited for a worker to come (or come back): the ones it found are new arrivals,
        # whose first offers may find no route to them yet (a NATS gateway link just back).
        waited = time.monotonic() - t_decide > self.cfg.sweep_interval_s
        _explain(decision, attempt, exclude, migration is not None, held_s)
        if isinstance(decision, Rejection):
            await self.reply_error(req, decision)
            return None
        queued_s = max(time.time() - req.created_at, 0.0)
        if attempt == 1:
            metrics.QUEUE_SECONDS.observe(queued_s)
        # NOTE: count the assignment before the first await: decisions of concurrent requests
        # interleave at every await, and must see each other's choices or they all herd onto
        # the worker that looked idlest in the last beat.
        reserved = self.registry.on_assigned(decision.ranked[0].worker.worker_id)
        route, silent = await self._offer_ranked(
            req, decision, reserved, attempt, queued_s, migration, on_accepted
        )
        if route is not None:
            return route
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

    async def _wait_turn(
        self,
        req: GenerateRequest,
        attempt: int,
        migration: Migration | None,
        pool: str,
        keepalive: Callable[[], Awaitable[None]] | None,
        held: asyncio.Semaphore | None,
    ) -> float | Rejection | None:
        """``place``'s first step, for a request's first attempt: a batch request waits for
        room (``hold_batch``), a new interactive one while its pools are full
        (``hold_while_full``: the seconds it was held, or the rejection flow control ended it
        with). None when it waited for nothing."""
        if attempt == 1 and req.priority == "batch":
            await self.hold_batch(req, keepalive, held)
        if attempt == 1 and req.priority != "batch" and migration is None and not pool:
            try:
                return await self.hold_while_full(req, keepalive, held)
            except Refused as r:
                return r.rejection
        return None

    async def _offer_ranked(
        self,
        req: GenerateRequest,
        decision: Decision,
        reserved: float,
        attempt: int,
        queued_s: float,
        migration: Migration | None,
        on_accepted: Callable[[], Awaitable[None]] | None,
    ) -> tuple[RouteReason | None, list[str]]:
        """``place`` offers ``req`` to ``decision``'s ranked workers in turn (the first already
        counted as assigned: ``reserved``): the route of the one that accepts, recorded, or
        None and the workers that did not answer at all (dead, not yet expired?)."""
        watched = self.fleet.replace_lost and await self.watch.watch(req)
        silent: list[str] = []
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
                if not watched:  # its end is never seen: out of the tenant's count at once
                    self.flow.ended(req, None)
                return route, silent
            self.registry.on_refused(route.worker_id, reserved)
            if answer is None:
                silent.append(route.worker_id)
        return None, silent


def _explain(
    decision: Decision | Rejection,
    attempt: int,
    exclude: frozenset[str],
    migrated: bool,
    held_s: float | None,
) -> None:
    """``place`` says in ``decision`` what happened before it: a later attempt moves a lost
    worker's request (the rejection says so, not just what is missing; the decision is
    ``migrated`` or ``replaced``), and a held request carries the seconds it was held."""
    if isinstance(decision, Rejection):
        if attempt > 1 and decision.code == "no_worker":
            lost = ", ".join(sorted(exclude))
            decision.code = "worker_lost"
            decision.message = f"worker {lost} was lost and {decision.message}"
        return
    if attempt > 1:
        decision.code = "migrated" if migrated else "replaced"
        decision.factors += [f"worker_lost:{w}" for w in sorted(exclude)]
    if held_s is not None:
        decision.factors.append(f"held:{held_s:.2f}")


def _excluded(w: WorkerView, exclude: frozenset[str], since: float) -> bool:
    return w.worker_id in exclude and w.joined_at <= since


def _min_load(workers: list[WorkerView]) -> float:
    return min((w.load for w in workers), default=float("inf"))
