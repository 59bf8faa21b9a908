"""The synchronous engine: add / abort / step. Used on one thread only.

:class:`~libs.engine.async_engine.AsyncEngineBackend` runs :meth:`LLMEngine.step` in a loop on
its engine thread; tests and the benchmark drive it directly. One step is

    schedule  → which sequences run how many tokens (Scheduler)
    execute   → one packed forward, logits at sampled positions (ModelRunner)
    update    → advance counters, register full blocks, sample, detokenize, check stops

and returns one :class:`StepOutput` per choice that produced output or finished.

Over 500 lines because the update is one state machine over the sequences the engine owns:
sampling, keeping or dropping speculative proposals, forking ``n`` choices, appending a token
through the detokenizer, stop strings, grammar and penalties, and the KV blocks a request
exports or imports all change the same ``Sequence`` and block tables within one step. What
stands alone is a module of its own (scheduler, runner, sampler, KV manager, speculation,
structured outputs, checks).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from libs.engine import metrics
from libs.engine.block_pool import BlockPool
from libs.engine.checks import check_kv_fits, check_logit_bias, check_prompt
from libs.engine.config import EngineSettings
from libs.engine.cuda_graphs import Capture
from libs.engine.detokenizer import IncrementalDetokenizer, Tokenizer
from libs.engine.errors import BackendError
from libs.engine.hashing import chain_hashes
from libs.engine.kv_manager import KvManager
from libs.engine.kv_transfer import KvBlocks
from libs.engine.loader import load_model
from libs.engine.lora import AdapterError, LoraSlots, NoFreeSlot
from libs.engine.model_runner import ModelRunner
from libs.engine.outputs import GenerationChunk, Resume
from libs.engine.params import (
    FinishReason,
    LogprobEntry,
    Priority,
    SamplingParams,
    Tenant,
    TokenLogprob,
)
from libs.engine.sampler import Sampler, SamplingRow, TokenLogprobs
from libs.engine.scheduler import Scheduler, SchedulerOutput
from libs.engine.sequence import SeqStatus, Sequence
from libs.engine.spec import make_speculator
from libs.engine.step_cost import StepCostModel
from libs.engine.structured import Grammars
from libs.log import fields

log = logging.getLogger("strait.engine")


@dataclass(slots=True)
class StepOutput:
    """New output of one choice of one request."""

    request_id: str
    chunk: GenerationChunk
    request_finished: bool  # every choice of the request has finished


def choice_seed(seed: int, index: int) -> int:
    """Seed of choice ``index`` of a request seeded ``seed`` (choice 0 uses ``seed`` itself)."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # manual_seed wants a non-negative int64


@dataclass(slots=True)
class _Request:
    request_id: str
    sampling: SamplingParams
    seqs: list[Sequence]
    grammar: str | None = None  # llguidance grammar text every choice follows
    matchers: list[Any] = field(default_factory=list)  # unused fresh matchers of grammar
    prediction: list[int] = field(default_factory=list)  # predicted output's tokens
    tenant: Tenant = field(default_factory=Tenant)  # every choice is served as it
    lora_slot: int = 0  # its LoRA adapter's slot (0: none), released when it ends
    lora_key: str = ""  # salts its sequences' block hashes


class LLMEngine:
    """Continuous-batching engine over one model. Not thread-safe: one thread calls it."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Tokenizer | None,
        settings: EngineSettings,
        model_id: str,
        *,
        seed: int | None = None,
        draft_model: torch.nn.Module | None = None,
        graph_capture: Capture | None = None,
        on_stage: Callable[[str], None] | None = None,
    ) -> None:
        """``draft_model``: the proposer's model when ``settings.speculative.method`` is
        "draft" (see :meth:`from_path`); ``graph_capture``, ``on_stage``: see
        :class:`ModelRunner`."""
        self.settings = settings
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.runner = ModelRunner(model, settings, graph_capture=graph_capture, on_stage=on_stage)
        self.pool = BlockPool(
            self.runner.num_blocks, settings.block_size, settings.enable_prefix_caching
        )
        self.kv = KvManager(self.pool, model_id)
        # What a step costs (fitted on every step): the scheduler's prompt allowance under
        # engine.itl_target_ms, and speculation's break-even.
        self.step_cost = StepCostModel()
        self.scheduler = Scheduler(settings, self.kv, self.step_cost)
        kernels = self.runner.kernels
        self.sampler = Sampler(
            seed,
            argmax=kernels.argmax_rows if kernels is not None else None,
            mask=kernels.mask_rows if kernels is not None else None,
        )
        self.max_model_len = self.runner.shape.context_limit(settings.max_model_len)
        if self.max_model_len < settings.max_model_len and self.runner.shape.sliding_window:
            log.info(
                "context limited to %d tokens, the model's sliding window (engine.max_model_len "
                "is %d)",
                self.max_model_len,
                settings.max_model_len,
            )
        self.eos_token_ids = _eos_ids(model, tokenizer)
        self.grammars: Grammars | None = None
        if tokenizer is not None:
            vocab = self.runner.shape.vocab_size
            self.grammars = Grammars(
                tokenizer, vocab, sorted(self.eos_token_ids), settings.structured
            )
        self.requests: dict[str, _Request] = {}
        # Speculative decoding (engine.speculative; None: off).
        self.speculator = make_speculator(
            settings, model_id, self.max_model_len, self.runner.shape.vocab_size, draft_model
        )
        if self.speculator is not None:
            self.speculator.cost = self.step_cost.decode
        # LoRA adapters by name (engine.max_loras; None when 0).
        self.loras: LoraSlots | None = None
        if self.runner.lora is not None:
            names = {model_id.split("@")[0], getattr(model.config, "_name_or_path", "") or ""}
            targets = self.runner.lora.targets({n for n in names if n})
            self.loras = LoraSlots(self.runner.lora, targets, settings.lora_dir)
        self.last_step_decode_only = False
        self.num_steps = 0
        # Resumed sequences whose given first token is reported by the next step.
        self._resumed: list[Sequence] = []

    @classmethod
    def from_path(
        cls,
        model_path: str | Path,
        settings: EngineSettings,
        model_id: str,
        draft_path: str | Path | None = None,
        **kw: Any,
    ) -> LLMEngine:
        """Load the model (and, for speculative method "draft", the draft model at
        ``draft_path``) from local directories; ``on_stage`` in ``kw`` hears each stage."""
        from transformers import AutoTokenizer

        if kw.get("on_stage") is not None:
            kw["on_stage"]("loading_model")

        tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
        model = load_model(model_path, settings)
        if draft_path is not None:  # small: its checkpoint's weights, in engine.dtype
            plain = settings.model_copy(update={"quantization": "none"})
            kw["draft_model"] = load_model(draft_path, plain)
        return cls(model, tokenizer, settings, model_id, **kw)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        sampling: SamplingParams,
        priority: Priority = "interactive",
        resume: Resume | None = None,
        grammar: str | None = None,
        matchers: Seq[Any] = (),
        prediction: Seq[int] = (),
        tenant: Tenant | None = None,
        lora: str = "",
    ) -> None:
        """Queue a request (its choice 0; choices 1..n-1 fork once the prompt is computed).

        With ``resume`` (n = 1 only), output tokens given by another worker are appended
        first (see :class:`libs.engine.outputs.Resume`): replayed ones silently, the handed-off one
        reported in the next step's output. ``grammar``: llguidance grammar text (from
        ``Grammars.compile``) that every choice's output follows; ``matchers``: fresh matchers
        of it made off this thread (choices without one get a new one here). ``prediction``:
        the tokens of the request's predicted output, proposed first by the speculator.
        ``tenant``: who the request is served as in the scheduler's fair share.
        ``lora``: the name of the LoRA adapter its rows run with ("": the base model), loaded
        from ``engine.lora_dir`` if it is not (see :meth:`acquire_lora`)."""
        if resume is not None and sampling.n != 1:
            raise BackendError("invalid_request", "a resumed request has one choice", "n")
        if request_id in self.requests:
            raise BackendError("invalid_request", f"request {request_id!r} is already running")
        # What the backends' prepare checked, again for direct callers (tests, benchmarks).
        vocab = self.runner.shape.vocab_size
        check_prompt(prompt_token_ids, sampling.max_tokens, self.max_model_len, vocab, "prompt")
        check_kv_fits(
            len(prompt_token_ids) + sampling.max_tokens, self.pool.block_size, self.pool.num_blocks
        )
        check_logit_bias(sampling, vocab)
        if grammar is not None and self.grammars is None:
            raise BackendError("invalid_request", "this engine has no tokenizer for grammars")
        req = _Request(
            request_id, sampling, [], grammar, list(matchers), list(prediction), tenant or Tenant()
        )
        if lora:
            req.lora_slot = self.acquire_lora(lora)
            req.lora_key = self.loras.key(req.lora_slot) if self.loras is not None else ""
        seq = self._new_sequence(req, 0, list(prompt_token_ids), priority)
        req.seqs.append(seq)
        self.requests[request_id] = req
        if resume is not None:
            for token in resume.replayed:
                self.sampler.skip(sampling, seq.generator, vocab)
                self._append(seq, token, None)
                if seq.is_finished:
                    break
            # The replayed output was streamed by the worker that produced it.
            seq.pending_text, seq.pending_token_ids = "", []
            if resume.token_id is not None and not seq.is_finished:
                self.sampler.skip(sampling, seq.generator, vocab)
                self._append(seq, resume.token_id, resume.logprobs)
                self._resumed.append(seq)
            if seq.is_finished:
                # Nothing left to run: the next step reports the finish (with no new tokens
                # when the replay itself ended the output).
                if seq not in self._resumed:
                    self._resumed.append(seq)
                return
        self.scheduler.add(seq)

    def _new_sequence(
        self, req: _Request, index: int, prompt: list[int], priority: Priority
    ) -> Sequence:
        sampling = req.sampling
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator().manual_seed(choice_seed(sampling.seed, index))
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, sampling.stop)
        matcher = None
        if req.matchers:
            matcher = req.matchers.pop()
        elif req.grammar is not None:
            assert self.grammars is not None
            matcher = self.grammars.matcher(req.grammar)
        return Sequence(
            request_id=req.request_id,
            index=index,
            token_ids=prompt,
            num_prompt_tokens=len(prompt),
            sampling=sampling,
            priority=priority,
            tenant=req.tenant.name,
            weight=req.tenant.weight,
            generator=generator,
            detokenizer=detok,
            matcher=matcher,
            prediction=req.prediction,
            lora_slot=req.lora_slot,
            lora_key=req.lora_key,
        )

    # ------------------------------------------------------------------ LoRA adapters

    def acquire_lora(self, name: str) -> int:
        """The slot of adapter ``name`` for one request (loaded from ``engine.lora_dir`` when
        it is not); the engine releases it when the request ends. BackendError when this
        engine cannot serve it: ``model_not_found`` (unknown or refused adapter) or
        ``no_capacity`` (every slot runs requests)."""
        if self.loras is None:
            raise BackendError(
                "model_not_found",
                f"the model {name!r} does not exist (this engine serves no LoRA adapters: "
                "engine.max_loras = 0)",
                "model",
            )
        try:
            slot = self.loras.acquire(name)
        except KeyError:
            raise BackendError(
                "model_not_found", f"the model {name!r} does not exist", "model"
            ) from None
        except AdapterError as e:
            raise BackendError("model_not_found", f"adapter {name!r} refused: {e}", "model") from e
        except NoFreeSlot as e:
            raise BackendError("no_capacity", str(e), "model", retry_after_s=1.0) from e
        metrics.LORA_REQUESTS.labels(adapter=name).inc()
        return slot

    def _release_lora(self, req: _Request) -> None:
        if req.lora_slot and self.loras is not None:
            self.loras.release(req.lora_slot)
            req.lora_slot = 0

    def abort_request(self, request_id: str) -> bool:
        """Drop a request and free its blocks; no further output. False if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self._release_lora(req)
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.remove(seq)
                if self.speculator is not None:
                    self.speculator.finished(seq)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[StepOutput]:
        """Schedule, run one forward, sample, and report new output."""
        resumed, self._resumed = self._resumed, []
        if self.speculator is not None:
            try:
                self.speculator.propose(self.scheduler.running)
            except Exception:
                # Proposals only ever save time: a proposer's failure costs this step's, never
                # a request.
                log.exception("speculative proposals failed; this step runs without them")
                for seq in self.scheduler.running:
                    seq.spec_tokens = []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return self._collect(resumed)
        # Metrics tell decode-only steps (the per-token cost) from those computing prompts.
        self.last_step_decode_only = all(i.num_new_tokens == 1 for i in sched.scheduled)
        started = time.perf_counter()
        logits = self.runner.execute(sched.scheduled)  # [S, vocab]
        self.num_steps += 1
        # Plain-greedy decode rows on a GPU: their tokens, with the next step already queued.
        ahead = self._run_ahead(sched, logits)
        outputs = self._update(sched, logits, resumed, ahead)
        # The whole step (forward, sampling, the device's sync): what a stream waits for.
        self._observe(sched, time.perf_counter() - started)
        return outputs

    def step_load(self) -> float:
        """The running decode rows' predicted step time over the ITL target (0: no target or
        no fit yet); the worker's beat carries it (``LoadInfo.step_load``)."""
        target = self.scheduler.itl_target_s
        if target <= 0:
            return 0.0
        predicted = self.step_cost.decode.predict(self.scheduler.decode_rows())
        return 0.0 if predicted is None else predicted / target

    def _observe(self, sched: SchedulerOutput, seconds: float) -> None:
        self.step_cost.observe(
            sched.num_decode_rows, sched.num_prefill_tokens, seconds, sched.prefill_work
        )
        target = self.scheduler.itl_target_s
        if target > 0 and seconds > target:
            if sched.budget is None:
                reason = "unfitted"  # the cost model has not seen enough steps yet
            else:
                reason = sched.budget.over_target or "mispredicted"
            metrics.STEPS_OVER_TARGET.labels(reason=reason).inc()

    def _run_ahead(self, sched: SchedulerOutput, logits: torch.Tensor) -> list[int] | None:
        """This step's tokens by :meth:`ModelRunner.run_ahead` (the next step launched on the
        device first; ``engine.cuda_run_ahead``), or None to sample as usual. Only where the
        next step is most likely that one: a graphed step of decode rows, each plain greedy
        (no bias, grammar, penalties, log-probabilities or proposals) and not at its length
        limit, nobody waiting to be admitted, and room for every row's next token (its block
        taken now, which the next step would take anyway)."""
        runner = self.runner
        if not (self.settings.cuda_run_ahead and runner.last_step_graphed):
            return None
        # Proposals (a speculative method, or a request's predicted output) would make the
        # next step another one.
        if self.settings.speculative.method != "off" or self.scheduler.num_waiting:
            return None
        for item in sched.scheduled:
            seq, p = item.seq, item.seq.sampling
            if item.num_new_tokens != 1 or item.spec or seq.prediction or not item.samples:
                return None
            if not (p.temperature == 0.0 or p.top_k == 1) or seq.matcher is not None:
                return None
            if p.logit_bias or p.logprobs is not None or p.repetition_penalty != 1.0:
                return None
            if p.frequency_penalty or p.presence_penalty:
                return None
            if (
                seq.num_output_tokens + 1 >= p.max_tokens
                or seq.num_tokens + 1 >= self.max_model_len
            ):
                return None
            if not self.kv.can_grow(seq, 2):
                return None
        for item in sched.scheduled:
            self.kv.grow(item.seq, 2)
        return runner.run_ahead(sched.scheduled, logits)

    def _update(
        self,
        sched: SchedulerOutput,
        logits: torch.Tensor,
        resumed: list[Sequence],
        tokens: list[int] | None = None,
    ) -> list[StepOutput]:
        """Advance the step's sequences and append their tokens: ``tokens`` when the step ran
        ahead (one per scheduled sequence, in order), else sampled from ``logits``."""
        row_logits: list[int] = []  # logits row of each sampling sequence
        sampling_seqs: list[Sequence] = []
        new_children: list[Sequence] = []
        # (sequence, its first logits row, its proposals) of each speculating sequence
        verifying: list[tuple[Sequence, int, list[int]]] = []
        num_logit_rows = 0
        for item in sched.scheduled:
            seq = item.seq
            samples = item.samples
            seq.num_computed_tokens += item.num_new_tokens
            self.kv.commit(seq)
            if not samples:
                continue
            family = [seq]
            if seq.index == 0 and not seq.forked and seq.sampling.n > 1:
                family += self._fork(seq)
                new_children += family[1:]
            for s in family:
                row_logits.append(num_logit_rows)
                sampling_seqs.append(s)
            if item.spec:
                verifying.append((seq, num_logit_rows, item.spec))
            num_logit_rows += 1 + len(item.spec)

        touched: list[Sequence] = list(resumed)
        if tokens is not None:
            # Decode rows only: one token a scheduled sequence, in order (see _run_ahead).
            for seq, token in zip(sampling_seqs, tokens, strict=True):
                self._append(seq, token, None)
            touched += sampling_seqs
        elif sampling_seqs:
            # One logits row per sampling sequence unless n > 1 choices were just forked or
            # proposals were run.
            same = len(row_logits) == logits.shape[0]
            self._sample(sampling_seqs, logits if same else logits[row_logits])
            touched += sampling_seqs
        if verifying:
            self._verify(verifying, logits)
        for child in new_children:
            if not child.is_finished:
                self.scheduler.add(child)
        return self._collect(touched)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample one token for each of ``seqs`` from its row of ``logits`` ``[len(seqs),
        vocab]`` and append it (detokenizer, stops, grammar, penalty counts)."""
        rows = [
            SamplingRow(s.sampling, s.generator, s.token_ids, s.output_counts, s.matcher)
            for s in seqs
        ]
        out = self.sampler(logits, rows)
        for seq, token, lp in zip(seqs, out.token_ids, out.logprobs, strict=True):
            self._append(seq, token, self._logprob_entry(lp) if lp is not None else None)

    def _verify(self, items: list[tuple[Sequence, int, list[int]]], logits: torch.Tensor) -> None:
        """Keep each sequence's proposals while they equal what the model samples.

        ``logits`` rows ``first + r`` of a sequence hold the model's next-token logits after its
        last token (r = 0, sampled with the rest of the batch) and after proposal ``r - 1``.
        Round r samples row r of the sequences whose token of round r - 1 equalled proposal
        r - 1 (so row r was computed on the sampled token) and that have not finished, with
        the same sampler, generator, penalties, grammar and stop checks as a step without
        proposals at that position: the output is the one without speculation, greedy or
        seeded. The last round (r = number of proposals) is the token after them all."""
        assert self.speculator is not None
        kept = [0] * len(items)
        alive = list(range(len(items)))
        r = 0
        while alive:
            nxt = []
            for j in alive:
                seq, _, spec = items[j]
                if seq.is_finished or r == len(spec) or seq.token_ids[-1] != spec[r]:
                    continue
                kept[j] += 1
                # Proposal r's K/V, computed in this forward, now belong to a sampled token.
                seq.num_computed_tokens += 1
                self.kv.commit(seq)
                nxt.append(j)
            r += 1
            if not nxt:
                break
            self._sample([items[j][0] for j in nxt], logits[[items[j][1] + r for j in nxt]])
            alive = nxt
        for (seq, _, spec), n in zip(items, kept, strict=True):
            self.speculator.record(seq, len(spec), n)
            if not seq.is_finished:
                self.kv.trim(seq)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Choices 1..n-1 of ``parent``'s request: same prompt, first token sampled from the
        same logits. They wait with no blocks and get the prompt's full blocks back as prefix
        hits (refcount sharing), recomputing only the partial last block."""
        parent.forked = True
        req = self.requests[parent.request_id]
        children = []
        for i in range(1, parent.sampling.n):
            child = self._new_sequence(
                req, i, parent.token_ids[: parent.num_prompt_tokens], parent.priority
            )
            child.arrival = parent.arrival
            child.forked = True
            child.num_cached_tokens = parent.num_cached_tokens
            children.append(child)
        req.seqs.extend(children)
        return children

    def _append(self, seq: Sequence, token: int, lp: LogprobEntry | None) -> None:
        """Add a sampled token; detokenize; finish the sequence on a stop condition."""
        seq.append_token(token)
        if lp is not None:
            seq.pending_logprobs.append(lp)
        p = seq.sampling
        reason: FinishReason | None = None
        grammar_ended = seq.matcher is not None and self._advance_grammar(seq, token)
        eos_ends = not p.ignore_eos or grammar_ended  # a grammar's own end is never ignored
        if token in p.stop_token_ids or (eos_ends and token in self.eos_token_ids):
            reason = "stop"  # the stop token's text is not part of the output
        elif seq.detokenizer is not None:
            seq.pending_text += seq.detokenizer.add_tokens([token])
            if seq.detokenizer.stopped:
                reason = "stop"
        if reason is None and grammar_ended:
            reason = "stop"
        if reason is None and (
            seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if reason is not None:
            if seq.detokenizer is not None:
                seq.pending_text += seq.detokenizer.finish()
            seq.finish_reason = reason
            if self.speculator is not None:
                self.speculator.finished(seq)
            if seq.status is SeqStatus.WAITING:  # a fork child that never ran
                seq.status = SeqStatus.FINISHED
            else:
                self.scheduler.remove(seq)

    @staticmethod
    def _advance_grammar(seq: Sequence, token: int) -> bool:
        """Feed ``token`` to the sequence's matcher; True when the grammar has ended (its EOS
        was taken, or the grammar allows nothing more). A token the grammar refuses can only
        come from outside the sampler's mask (a resumed token of another grammar): the output
        ends there rather than continue unconstrained."""
        m = seq.matcher
        if not m.consume_token(token):
            log.warning(
                "token outside the grammar",
                extra=fields(request_id=seq.request_id, error=m.get_error()),
            )
            return True
        return bool(m.is_stopped())

    def _logprob_entry(self, lp: TokenLogprobs) -> LogprobEntry:
        text = self._token_text
        return LogprobEntry(
            token=text(lp.token_id),
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[
                TokenLogprob(token=text(t), logprob=v, token_id=t)
                for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
            ],
        )

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _collect(self, touched: list[Sequence]) -> list[StepOutput]:
        """One StepOutput per touched choice; ``request_finished`` is set on the last output of
        a request whose choices have all finished, and the engine forgets that request."""
        outputs: list[StepOutput] = []
        last_of: dict[str, int] = {}
        for seq in touched:
            if seq.request_id not in self.requests:
                continue
            chunk = GenerationChunk(
                index=seq.index,
                text=seq.pending_text,
                token_ids=seq.pending_token_ids,
                finish_reason=seq.finish_reason,
                logprobs=seq.pending_logprobs or None,
                num_prompt_tokens=seq.num_prompt_tokens,
                num_cached_tokens=seq.num_cached_tokens,
                num_spec_proposed=seq.spec_proposed,
                num_spec_accepted=seq.spec_accepted,
            )
            if seq.lora_slot and self.loras is not None and seq.pending_token_ids:
                adapter = self.loras.name(seq.lora_slot)
                metrics.LORA_TOKENS.labels(adapter=adapter).inc(len(seq.pending_token_ids))
            seq.pending_text, seq.pending_token_ids, seq.pending_logprobs = "", [], []
            last_of[seq.request_id] = len(outputs)
            outputs.append(StepOutput(seq.request_id, chunk, False))
        for request_id, i in last_of.items():
            req = self.requests[request_id]
            if len(req.seqs) == req.sampling.n and all(s.is_finished for s in req.seqs):
                outputs[i].request_finished = True
                self._release_lora(req)
                del self.requests[request_id]
        return outputs

    # ------------------------------------------------------------------ KV handoff

    def export_prefix(self, token_ids: Seq[int]) -> KvBlocks | None:
        """The cached full blocks at the start of ``token_ids`` (e.g. a prompt this engine just
        prefilled), as transferable bytes; None when the first block is not cached."""
        hashes = chain_hashes(token_ids, self.pool.block_size, self.model_id)
        blocks: list[int] = []
        for h in hashes:
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        if not blocks:
            return None
        data = self.runner.read_blocks(blocks)
        return KvBlocks.from_tensor(self.model_id, hashes[: len(blocks)], data)

    def import_prefix(self, kv: KvBlocks) -> int:
        """Put exported blocks into this engine's prefix cache (free, cached: the next request
        with that prefix gets hits). Returns how many blocks were new here."""
        h = kv.header
        expected = list(self.runner.kv_cache.data.shape)
        expected[3] = len(h.block_hashes)
        if h.model_id != self.model_id or h.shape != expected or h.layer_start != 0:
            raise ValueError(
                f"KV blocks of {h.model_id} {h.shape} do not fit {self.model_id} {expected}"
            )
        if not self.pool.enable_prefix_caching:
            return 0
        new = [i for i, bh in enumerate(h.block_hashes) if self.pool.lookup(bh) is None]
        new = new[: self.pool.num_free]
        if not new:
            return 0
        blocks = self.pool.allocate(len(new))
        self.runner.write_blocks(blocks, kv.data[:, :, :, new])
        for b, i in zip(blocks, new, strict=True):
            self.pool.register(b, h.block_hashes[i])
        self.pool.release(blocks)
        return len(blocks)

    # ------------------------------------------------------------------ state

    def drain_kv_events(self) -> tuple[list[int], list[int]]:
        return self.pool.drain_events()


def _eos_ids(model: torch.nn.Module, tokenizer: Tokenizer | None) -> frozenset[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, list):
        ids.update(eos)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int):
        ids.add(tok_eos)
    return frozenset(ids)


__all__ = ["LLMEngine", "Resume", "StepOutput", "choice_seed"]
