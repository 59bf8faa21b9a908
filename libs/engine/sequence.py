"""Per-sequence state: one :class:`Sequence` per choice of a request (``n`` choices → ``n``).

Created by :meth:`libs.engine.engine.LLMEngine.add_request` (choice 0) and by forking after the
prompt is computed (choices 1..n-1 share the prompt's blocks). Mutated only on the engine thread:
the scheduler moves it between queues, the KV manager fills ``block_table``, the engine appends
sampled tokens and decides when it is finished.

Token accounting (all counts in tokens):

- ``token_ids`` = prompt + output so far;
- ``num_computed_tokens``: tokens whose K/V are in this sequence's blocks;
- the tokens still to run are ``token_ids[num_computed_tokens:]``: the rest of the prompt while
  prefilling, exactly one (the last sampled token) while decoding. After a preemption
  ``num_computed_tokens`` drops to 0 and the whole of ``token_ids`` is recomputed.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from libs.engine.detokenizer import IncrementalDetokenizer
from libs.engine.params import (
    PRIORITY_BANDS,
    FinishReason,
    LogprobEntry,
    Priority,
    SamplingParams,
)

# Scheduling class of each priority: lower runs first.
PRIORITY_CLASS: dict[str, int] = {band: i for i, band in enumerate(PRIORITY_BANDS)}
BATCH_CLASS = PRIORITY_CLASS["batch"]

_arrival = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not yet admitted, or preempted (blocks freed; will be recomputed)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    """One choice of one request. Identity-compared (``eq=False``)."""

    request_id: str
    index: int  # choice index (0..n-1)
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    priority: Priority = "interactive"
    # Who the request is served as and its weight (libs/flow: the scheduler's fair share of
    # tokens between tenants); "" is one anonymous tenant.
    tenant: str = ""
    weight: float = 1.0
    # Counted in the scheduler's fair share (from its first queueing to its removal).
    in_share: bool = False
    # Per-choice random generator when the request has a seed (reproducible whatever the batch).
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    # llguidance matcher of a constrained request, advanced with every output token.
    matcher: Any = None
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Chain hashes of this sequence's full blocks, in order (filled as blocks complete).
    block_hashes: list[int] = field(default_factory=list)
    # Leading blocks of block_table already offered to the prefix cache (KvManager.commit).
    num_registered_blocks: int = 0
    # Prompt tokens served from the prefix cache at the first admission.
    num_cached_tokens: int = 0
    # Set once the prompt has been computed and choice 0 has spawned its siblings.
    forked: bool = False
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Output produced since the engine last reported this sequence (drained every step).
    pending_text: str = ""
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[LogprobEntry] = field(default_factory=list)
    # Output token counts (token id → count) for presence/frequency penalties.
    output_counts: dict[int, int] = field(default_factory=dict)
    arrival: int = field(default_factory=lambda: next(_arrival))
    # Speculative decoding (libs/engine/spec): tokens proposed for the coming step (never part
    # of token_ids until verified), the proposer's per-sequence index, the acceptance rate the
    # adaptive depth follows (EMA, 0..1; None: none measured yet, the worker's recent rate
    # stands in), steps spent at depth 0, and totals for the request.
    spec_tokens: list[int] = field(default_factory=list)
    spec_index: Any = None
    spec_rate: float | None = None
    spec_idle: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    # The request's predicted output (tokens; SamplingParams.prediction), shared by its
    # choices, and the proposer's index over it.
    prediction: list[int] = field(default_factory=list)
    prediction_index: Any = None
    # The request's LoRA adapter (libs/engine/lora): its slot in the runner's stacks (0: none)
    # and the key that salts this sequence's block hashes (""; no KV reuse across adapters).
    lora_slot: int = 0
    lora_key: str = ""

    @property
    def priority_class(self) -> int:
        return PRIORITY_CLASS[self.priority]

    @property
    def is_batch(self) -> bool:
        return self.priority_class == BATCH_CLASS

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """True until the prompt (and, after a preemption, earlier output) has been computed."""
        return self.num_uncomputed_tokens > 1 or self.num_output_tokens == 0

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.pending_token_ids.append(token_id)
        self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1

    def sort_key(self) -> tuple[int, int, int]:
        """Scheduling order: priority class, then arrival (FCFS within a class), then choice."""
        return (self.priority_class, self.arrival, self.index)
