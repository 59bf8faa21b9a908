"""FAKE backend for load tests of routing and streaming. Never a default; never model results.

It produces deterministic pseudo-words on a timing model (``FakeEngineSettings``): a prompt costs
``per_prompt_token_s`` per uncached prompt token before the first token, and each output token
costs ``per_token_s`` plus ``per_row_s`` for every other request the worker runs at that moment
(:meth:`FakeBackend.token_s`), so its ITL grows with its batch as a real engine's step does.
configs/fake-calibrated.toml sets them to the real worker's measured costs. Tokens are whitespace-separated words hashed to ids, so prefix overlap and
KV events behave like a real worker's at block granularity. An answer runs to ``max_tokens``
("length"), or ends after ``answer_words`` words ("stop") when that knob is set and fewer.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Literal

from libs.engine.checks import check_prompt
from libs.engine.errors import BackendError
from libs.engine.fair import FairShare
from libs.engine.outputs import GenerationChunk, LoadInfo, PreparedPrompt, Resume
from libs.engine.params import PRIORITY_BANDS, ChatMessage, Priority, SamplingParams, Tenant
from libs.engine.tools import CALL_CLOSE, CALL_OPEN, ToolSpec
from libs.flow.gate import FairGate
from libs.settings import FakeEngineSettings

FAKE_VOCAB = 50_000
_WORDS = (
    "the a river runs under bridges of light while quiet engines hum and tokens flow "
    "through narrow straits toward open water where ships wait for morning tides"
).split()


def _word_id(word: str) -> int:
    return (
        int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "little")
        % FAKE_VOCAB
    )


def fake_prompt_text(prompt: str | None, messages: list[ChatMessage] | None) -> str:
    """The text the fake backend runs: the prompt, or ``role: content`` lines of the messages."""
    if prompt is not None:
        return prompt
    return "\n".join(f"{m.role}: {m.content}" for m in messages or [])


def fake_token_ids(text: str) -> list[int]:
    """The fake tokenizer: one id per whitespace-separated word (the router hashes the same)."""
    return [_word_id(w) for w in text.split()] or [0]


def _block_hash(parent: int, ids: list[int], model: str) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little", signed=True))
    h.update(model.encode())
    h.update(b"".join(i.to_bytes(4, "little") for i in ids))
    return int.from_bytes(h.digest(), "little", signed=True)


class FakeBackend:
    """Implements ``libs.backend.Backend`` with sleeps instead of a model."""

    def __init__(
        self,
        settings: FakeEngineSettings,
        model_name: str = "fake",
        block_size: int = 16,
        capacity: int = 64,
        cache_blocks: int = 4096,
        headroom: int = 0,
        prompt_cost: float = 1.0,
    ) -> None:
        self.settings = settings
        self.model_name = model_name
        self.model_id = model_name  # one format: the fake has no weights
        self.max_model_len = settings.max_model_len
        self.block_size = block_size
        self.capacity = capacity
        self._running: dict[str, int] = {}
        # Seated in fair-share order like the engine's scheduler (``engine.fair_*``).
        self._gate = FairGate(capacity, headroom, FairShare(prompt_cost=prompt_cost))
        self._waiting = 0
        # Prefix cache of block hashes (LRU), so cached prompts are cheaper like a real worker's.
        self._cache: OrderedDict[int, None] = OrderedDict()
        self._cache_blocks = cache_blocks
        self._stored: list[int] = []
        self._evicted: list[int] = []
        self._aborted: set[str] = set()

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def prepare(
        self,
        *,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        messages: list[ChatMessage] | None,
        sampling: SamplingParams,
        tools: ToolSpec | None = None,
    ) -> PreparedPrompt:
        if sampling.structured is not None:
            raise BackendError(
                "invalid_request",
                "the fake engine enforces no grammar: structured outputs need a model pool",
                "structured",
            )
        # A forced call: the answer is that call with empty arguments (whatever its schema),
        # carried as the prompt's "grammar" to ``generate``.
        forced = None
        if tools is not None and tools.forced:
            name = tools.callable()[0].name
            forced = f'{CALL_OPEN}{{"name": "{name}", "arguments": {{}}}}{CALL_CLOSE}'

        if prompt_token_ids is not None:
            ids = list(prompt_token_ids)
            text = ""
        else:
            text = fake_prompt_text(prompt, messages)
            ids = fake_token_ids(text)
        param = "messages" if messages is not None else "prompt"
        check_prompt(ids, sampling.max_tokens, self.max_model_len, FAKE_VOCAB, param)
        return PreparedPrompt(token_ids=ids, text=text, grammar=forced)

    def block_hashes(self, ids: list[int]) -> list[int]:
        out, parent = [], 0
        for start in range(0, len(ids) - self.block_size + 1, self.block_size):
            parent = _block_hash(parent, ids[start : start + self.block_size], self.model_name)
            out.append(parent)
        return out

    def _touch_prefix(self, ids: list[int]) -> int:
        """Cache the prompt's full blocks; returns how many prompt tokens were already cached."""
        cached, hit = 0, True
        for h in self.block_hashes(ids):
            if hit and h in self._cache:
                cached += self.block_size
                self._cache.move_to_end(h)
                continue
            hit = False
            if h not in self._cache:
                self._cache[h] = None
                self._stored.append(h)
                if len(self._cache) > self._cache_blocks:
                    old, _ = self._cache.popitem(last=False)
                    self._evicted.append(old)
        return cached

    async def generate(
        self,
        request_id: str,
        prompt: PreparedPrompt,
        sampling: SamplingParams,
        priority: Priority,
        resume: Resume | None = None,
        tenant: Tenant | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        who = tenant or Tenant()
        if resume is not None and (resume.token_id is not None or sampling.n != 1):
            raise BackendError("invalid_request", "the fake backend does not take KV handoffs")
        # A migrated request: its first ``replayed`` words were streamed by another worker.
        skip = len(resume.replayed) if resume is not None else 0
        self._waiting += 1
        try:
            await self._gate.acquire(who.name, who.weight, PRIORITY_BANDS.index(priority))
        finally:
            self._waiting -= 1
        self._running[request_id] = len(prompt.token_ids)
        try:
            n_prompt = len(prompt.token_ids)
            cached = self._touch_prefix(prompt.token_ids)
            self._gate.fair.charge(who.name, prompt_tokens=n_prompt - cached)
            await asyncio.sleep((n_prompt - cached) * self.settings.per_prompt_token_s)
            if prompt.grammar is not None:
                for i in range(sampling.n):
                    yield GenerationChunk(i, prompt.grammar, [1], "stop", None, n_prompt, cached)
                return
            rngs = [random.Random(f"{sampling.seed}:{i}:{n_prompt}") for i in range(sampling.n)]
            done = [False] * sampling.n
            # Words an answer has: max_tokens (finish "length"), or answer_words when fewer
            # (finish "stop", as a model's end of sequence).
            n_words = sampling.max_tokens
            if self.settings.answer_words:
                n_words = min(n_words, self.settings.answer_words)
            ended: Literal["length", "stop"] = (
                "length" if n_words == sampling.max_tokens else "stop"
            )
            for step in range(n_words):
                if request_id in self._aborted:
                    return
                if step > skip:
                    await asyncio.sleep(self.token_s())
                for i, rng in enumerate(rngs):
                    if done[i]:
                        continue
                    word = rng.choice(_WORDS)
                    if step < skip:  # same draws as the first worker, not streamed again
                        continue
                    self._gate.fair.charge(who.name, output_tokens=1)
                    text = word if step == 0 else " " + word
                    last = step == n_words - 1
                    stop_hit = any(s and s in text for s in sampling.stop)
                    if stop_hit:
                        done[i] = True
                        yield GenerationChunk(i, "", [], "stop", None, n_prompt, cached)
                        continue
                    done[i] = last
                    yield GenerationChunk(
                        i,
                        text,
                        [_word_id(word)],
                        ended if last else None,
                        None,
                        n_prompt,
                        cached,
                    )
                if all(done):
                    return
        finally:
            self._running.pop(request_id, None)
            self._aborted.discard(request_id)
            self._gate.release(who.name)

    def token_s(self) -> float:
        """Seconds one output token takes now: one step of a batch of the running requests."""
        others = max(len(self._running) - 1, 0)
        return self.settings.per_token_s + self.settings.per_row_s * others

    def abort(self, request_id: str) -> None:
        if request_id in self._running:
            self._aborted.add(request_id)

    def load(self) -> LoadInfo:
        stored, evicted = self._stored, self._evicted
        self._stored, self._evicted = [], []
        used = len(self._cache)
        return LoadInfo(
            running=len(self._running),
            waiting=self._waiting,
            kv_blocks_used=used,
            kv_blocks_free=max(self._cache_blocks - used, 0),
            capacity=self.capacity,
            block_size=self.block_size,
            stored_hashes=stored,
            evicted_hashes=evicted,
        )
