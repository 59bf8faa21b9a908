"""Decides, each step, how many tokens of which sequences run (continuous batching).

Called by :meth:`libs.engine.engine.LLMEngine.step` once per step; owns the waiting and running
queues. Policy:

- order is priority band (interactive, standard, batch), then, with ``engine.fair_share``,
  the tenant's weighted count of tokens served (:class:`libs.engine.fair.FairShare`, charged
  with every token a step runs), then arrival;
- a waiting tenant with no sequence running gets a seat while ``max_num_seqs`` are taken, up
  to ``fair_headroom_seqs`` more, and then (``fair_preempt``) by preempting the sequence last
  in that order, so one tenant's flood never keeps another's first request waiting for a seat;
  its first prompt runs in a step of its own (``fair_first_prompt_alone_every``: the running
  sequences sit out that step, at most once every that many steps);
- while a light tenant (one request at a time) shares the engine with another,
  ``fair_shared_max_num_seqs`` (when set) takes the place of ``max_num_seqs`` as the seats
  (:meth:`Scheduler.seats`): shorter steps, so its TTFT is the rest of a short step; a lone
  tenant, or floods beside floods, keep every seat;
- running sequences are served first, in that order: a decoding one gets 1 token, a
  prefilling one a chunk of at most ``prefill_chunk_tokens``, all under one per-step budget of
  ``max_num_batched_tokens``;
- with an inter-token target (``engine.itl_target_ms``), the step's prompt tokens (chunks of
  running and newly admitted sequences together) are further capped so that the step's
  predicted time stays under it (``StepCostModel.prefill_budget``: decode rows first, prompts
  get the rest of the target, at least ``min_prefill_tokens``);
- when blocks run out, the last sequence in that order (the tenant furthest over its share)
  is preempted (blocks freed, put back to
  waiting; it is recomputed later, keeping the tokens it already produced);
- waiting sequences are then admitted in order while the budget, ``max_num_seqs`` and free
  blocks allow, reusing prefix-cache hits; an interactive arrival may preempt running batch
  work to get in;
- with ``batch_yields_to_prompts``, batch-class sequences sit out every step that computes an
  interactive prompt (one is waiting or prefilling): they keep their blocks and go on in the
  next step without one, so an interactive prompt's step carries no batch rows or chunks and
  its TTFT is what it would be without the batch.

The output is ``{sequence: number of tokens}`` (a list of :class:`ScheduledSeq`), not "one token
per decode": a decoding sequence with proposed tokens (``Sequence.spec_tokens``, set by
:mod:`libs.engine.spec`) runs its last token and the proposals, to be verified by the engine.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from libs.engine.config import EngineSettings
from libs.engine.fair import FairShare
from libs.engine.kv_manager import KvManager
from libs.engine.sequence import SeqStatus, Sequence
from libs.engine.step_cost import PrefillBudget, StepCostModel


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens of seq.token_ids run this step, from seq.num_computed_tokens on
    # Proposed tokens run after them (speculative decoding; only for a decoding sequence):
    # not in seq.token_ids; the engine keeps those equal to what it samples at their positions.
    spec: list[int] = field(default_factory=list)
    start: int = 0  # seq.num_computed_tokens when scheduled (where this step's tokens begin)

    @property
    def samples(self) -> bool:
        """True when this step reaches the sequence's last token (so a token is sampled)."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # The prompt-token allowance under the inter-token target (None: no target, or no fit yet).
    budget: PrefillBudget | None = None

    @property
    def num_decode_rows(self) -> int:
        """Decoding sequences and their proposals (the step-cost model's ``rows``)."""
        return sum(1 + len(s.spec) for s in self.scheduled if s.num_new_tokens == 1)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if s.num_new_tokens > 1)

    @property
    def prefill_work(self) -> float:
        """(query, earlier key) pairs the prompt chunks attend over (the step-cost model's
        context term): ``P * start + P * (P - 1) / 2`` a chunk."""
        return sum(
            s.num_new_tokens * s.start + s.num_new_tokens * (s.num_new_tokens - 1) / 2
            for s in self.scheduled
            if s.num_new_tokens > 1
        )

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens + len(s.spec) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


# A tenant with at most this many sequences here is light for ``Scheduler.seats``: one request at
# a time (an interactive user), each arriving with nothing running.
LIGHT_TENANT_SEQS = 1


class Scheduler:
    def __init__(
        self,
        settings: EngineSettings,
        kv: KvManager,
        cost: StepCostModel | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kv = kv
        self.max_num_batched_tokens = settings.max_num_batched_tokens
        self.max_num_seqs = settings.max_num_seqs
        self.chunk = settings.prefill_chunk_tokens or settings.max_num_batched_tokens
        self.itl_target_s = settings.itl_target_ms / 1000
        self.min_prefill_tokens = settings.min_prefill_tokens
        self.batch_yields_to_prompts = settings.batch_yields_to_prompts
        self.cost = cost if cost is not None else StepCostModel()
        self.fair = (
            FairShare(prompt_cost=settings.fair_prompt_token_cost) if settings.fair_share else None
        )
        self.headroom = settings.fair_headroom_seqs if settings.fair_share else 0
        self.fair_preempt = settings.fair_share and settings.fair_preempt
        self.alone_every = settings.fair_first_prompt_alone_every if settings.fair_share else 0
        self._since_alone = self.alone_every  # steps since the last newcomer's step alone
        self.shared_seats = settings.fair_shared_max_num_seqs if settings.fair_share else 0
        self.shared_window_s = settings.fair_shared_window_s
        self.clock = clock
        # tenant -> when (clock s) its last sequence arrived or finished; pruned past the window.
        self._seen: dict[str, float] = {}
        self._seats = self.max_num_seqs  # seats() as of this step, set once in schedule()
        self.num_alone_steps = 0
        # Waiting sequences, unordered (``_order`` picks; the queue is at most the worker's
        # max_waiting plus the preempted); aborted ones are dropped lazily (status FINISHED).
        self._waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_fair_preemptions = 0

    # ------------------------------------------------------------------ queues

    @property
    def num_waiting(self) -> int:
        return sum(1 for s in self._waiting if not s.is_finished)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.running) or self._peek_waiting() is not None

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` (new, forked or preempted) as waiting."""
        seq.status = SeqStatus.WAITING
        self._seen[seq.tenant] = self.clock()
        if self.fair is not None and not seq.in_share:
            self.fair.enter(seq.tenant, seq.weight)
            seq.in_share = True
        self._waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted ``seq`` out of the running queue and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SeqStatus.FINISHED
        self._seen[seq.tenant] = self.clock()
        if self.fair is not None and seq.in_share:
            self.fair.leave(seq.tenant)
            seq.in_share = False

    def _order(self, seq: Sequence) -> tuple[int, float, int, int]:
        """Scheduling order: band, the tenant's counter (with fair share), arrival, choice."""
        counter = self.fair.counter(seq.tenant) if self.fair is not None else 0.0
        return (seq.priority_class, counter, seq.arrival, seq.index)

    def _peek_waiting(self) -> Sequence | None:
        if any(s.is_finished for s in self._waiting):
            self._waiting = [s for s in self._waiting if not s.is_finished]
        return min(self._waiting, key=self._order, default=None)

    def _unseated(self) -> Sequence | None:
        """The first waiting sequence, in order, of a tenant with no sequence running."""
        seated = {s.tenant for s in self.running}
        return min(
            (s for s in self._waiting if not s.is_finished and s.tenant not in seated),
            key=self._order,
            default=None,
        )

    def seats(self) -> int:
        """Sequences that may run before the headroom: ``fair_shared_max_num_seqs`` while two
        or more tenants are present (a sequence here, or one within ``fair_shared_window_s``)
        and one of them is light (at most ``LIGHT_TENANT_SEQS`` sequences here: its next
        request arrives with nothing running, and waits for the step under way), else
        ``max_num_seqs``: floods beside floods keep every seat."""
        if not self.shared_seats or self.shared_seats >= self.max_num_seqs:
            return self.max_num_seqs
        now = self.clock()
        self._seen = {t: at for t, at in self._seen.items() if now - at <= self.shared_window_s}
        here: dict[str, int] = dict.fromkeys(self._seen, 0)
        for s in itertools.chain(self.running, self._waiting):
            if not s.is_finished:
                here[s.tenant] = here.get(s.tenant, 0) + 1
        light = any(n <= LIGHT_TENANT_SEQS for n in here.values())
        return self.shared_seats if len(here) >= 2 and light else self.max_num_seqs

    def _next_admission(self) -> Sequence | None:
        """The waiting sequence to admit next, if it may have a seat. With fair share, a
        tenant with no sequence running goes first in its band (its first request never waits
        behind another tenant's queue), while :meth:`seats` plus ``fair_headroom_seqs`` seats are
        not taken; then the first in order while :meth:`seats` are not."""
        head = self._peek_waiting()
        seats = self._seats
        if self.fair is not None and len(self.running) < seats + self.headroom:
            new = self._unseated()
            if new is not None and head is not None and new.priority_class <= head.priority_class:
                return new
        return head if len(self.running) < seats else None

    def _newcomer_alone(self) -> bool:
        """Whether this step computes only the first prompts of tenants with nothing running
        (``fair_first_prompt_alone_every``): one such waits, may take a seat now, and the last
        step alone was at least that many steps ago. Counts the step either way."""
        self._since_alone += 1
        if not self.alone_every or self._since_alone < self.alone_every or not self.running:
            return False
        new = self._unseated()
        head = self._peek_waiting()
        if new is None or head is None or new.priority_class > head.priority_class:
            return False
        if new is not self._next_admission() or new.num_preemptions:
            return False
        self._since_alone = 0
        self.num_alone_steps += 1
        return True

    def _preempt_for_unseated(self, out: SchedulerOutput) -> None:
        """``fair_preempt``: every seat and the headroom are taken and a tenant with none
        running waits: preempt the running sequence last in order (the newest of the tenant
        furthest over its share, in the lowest band) unless its band is above the waiting
        one's or it is its tenant's only seat."""
        if not self.fair_preempt or len(self.running) < self._seats + self.headroom:
            return
        new, last = self._unseated(), self.running[-1]
        if new is None or last.priority_class < new.priority_class:
            return
        if sum(1 for s in self.running if s.tenant == last.tenant) < 2:
            return
        self.num_fair_preemptions += 1
        self._preempt(self.running[-1], out)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)
        out.preempted.append(seq)

    # ------------------------------------------------------------------ the step

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._seats = self.seats()  # once a step: it walks the queues
        self.running.sort(key=self._order)
        self._make_room_for_interactive(out)
        self._preempt_for_unseated(out)
        # Running is sorted by class: batch-class sequences sitting out are its tail.
        batch_sits_out = self._batch_sits_out()
        alone = self._newcomer_alone()
        budget = self.max_num_batched_tokens
        prompt_left = self._prompt_allowance(out, batch_sits_out)

        out_of_blocks = False
        i = len(self.running) if alone else 0  # alone: every running sequence sits out
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if batch_sits_out and seq.is_batch:
                break
            n = min(seq.num_uncomputed_tokens, self.chunk, budget)
            if seq.num_uncomputed_tokens > 1:  # a prompt chunk (or a preempted one's recompute)
                n = min(n, prompt_left)
                if n == 0:
                    i += 1  # its chunk waits for a step with room; decode rows go on
                    continue
                prompt_left -= n
            # A decoding sequence's proposals ride along while the budget and free blocks allow;
            # they are dropped before anyone is preempted for them.
            spec = seq.spec_tokens[: budget - 1] if seq.num_uncomputed_tokens == 1 else []
            if spec and not self.kv.can_grow(seq, n + len(spec)):
                spec = []
            while not self.kv.can_grow(seq, n) and seq in self.running:
                out_of_blocks = True
                self._preempt(self.running[-1], out)
            if seq not in self.running:  # it was the last one and got preempted itself
                break
            self.kv.grow(seq, n + len(spec))
            out.scheduled.append(ScheduledSeq(seq, n, spec, seq.num_computed_tokens))
            budget -= n + len(spec)
            i += 1

        while budget > 0 and not out_of_blocks:
            new = self._next_admission()
            if new is None or (batch_sits_out and new.is_batch):
                break
            if alone and any(s.tenant == new.tenant for s in self.running):
                break  # a step alone admits only the tenants that had nothing running
            hits = self.kv.find_prefix(new)
            cached = len(hits) * self.kv.block_size
            n = min(new.num_tokens - cached, self.chunk, budget, prompt_left)
            if n <= 0:
                break
            if not self.kv.can_admit(hits, cached + n):
                break
            self._waiting.remove(new)
            self.kv.admit(new, hits, n)
            if new.num_preemptions == 0:  # first admission (a resumed handoff has output)
                new.num_cached_tokens = cached
            new.status = SeqStatus.RUNNING
            self.running.append(new)
            out.scheduled.append(ScheduledSeq(new, n, start=new.num_computed_tokens))
            budget -= n
            prompt_left -= n
        self._charge(out)
        return out

    def _charge(self, out: SchedulerOutput) -> None:
        """Count this step's tokens to their tenants: prompt chunks (and recomputes) as prompt
        tokens, a decoding row and its proposals as output tokens."""
        if self.fair is None:
            return
        for s in out.scheduled:
            if s.num_new_tokens > 1 or s.seq.num_output_tokens == 0:
                self.fair.charge(s.seq.tenant, prompt_tokens=s.num_new_tokens)
            else:
                self.fair.charge(s.seq.tenant, output_tokens=s.num_new_tokens + len(s.spec))

    def decode_rows(self, batch: bool = True) -> int:
        """Rows the running decoding sequences take next step (each one plus its proposals);
        without ``batch``, those of interactive sequences only."""
        return sum(
            1 + len(s.spec_tokens)
            for s in self.running
            if s.num_uncomputed_tokens == 1 and (batch or not s.is_batch)
        )

    def _prompt_allowance(self, out: SchedulerOutput, batch_sits_out: bool = False) -> int:
        """Prompt tokens this step may carry: all of the budget without a target (or before
        the cost model has seen enough steps), else what the target leaves after the decode
        rows that run (``out.budget`` says how it was decided)."""
        if self.itl_target_s <= 0:
            return self.max_num_batched_tokens
        rows = self.decode_rows(batch=not batch_sits_out)
        # Where the step's prompt tokens begin: the first running prompt's next chunk (it
        # takes the allowance first), else a new admission's (0, or its cached prefix).
        start = next(
            (
                s.num_computed_tokens
                for s in self.running
                if s.num_uncomputed_tokens > 1 and not (batch_sits_out and s.is_batch)
            ),
            0,
        )
        out.budget = self.cost.prefill_budget(
            self.itl_target_s,
            rows,
            self.min_prefill_tokens,
            max(self.max_num_batched_tokens - rows, 0),
            start,
        )
        return self.max_num_batched_tokens if out.budget is None else out.budget.tokens

    def _batch_sits_out(self) -> bool:
        """Whether batch work sits out this step: ``batch_yields_to_prompts`` and an
        interactive prompt waits or is being computed (its TTFT runs)."""
        if not self.batch_yields_to_prompts:
            return False
        head = self._peek_waiting()
        if head is not None and not head.is_batch:
            return True
        return any(not s.is_batch and s.is_prefilling for s in self.running)

    def _make_room_for_interactive(self, out: SchedulerOutput) -> None:
        """Preempt running batch-class work while an interactive or standard arrival cannot
        get in."""
        head = self._peek_waiting()
        if head is None or head.is_batch:
            return
        while self.running and self.running[-1].is_batch:
            hits = self.kv.find_prefix(head)
            first = len(hits) * self.kv.block_size + min(
                head.num_tokens - len(hits) * self.kv.block_size, self.chunk
            )
            if len(self.running) < self.max_num_seqs and self.kv.can_admit(hits, first):
                return
            self._preempt(self.running[-1], out)
