"""``AsyncEngineBackend``: the real engine behind the workers' ``Backend`` protocol.

Threads: the worker's asyncio loop calls :meth:`prepare` (tokenize, validate), iterates
:meth:`generate`, calls :meth:`abort` and :meth:`load`. The engine itself lives on one dedicated
thread (``strait-engine``) that loops ``drain inbox → LLMEngine.step() → deliver``; torch
releases the GIL during the forward, so the event loop is never blocked by it. The two sides
talk only through a command inbox (thread-safe queue + wake event) one way and
``loop.call_soon_threadsafe`` the other way.

    event loop                                   engine thread
    generate() ──("add", …)──► inbox ──────────► LLMEngine.add_request
    abort()    ──("abort", …)► inbox ──────────► LLMEngine.abort_request
    per-request OutputStream ◄── call_soon_threadsafe ◄── LLMEngine.step() outputs

Token frames: a request's outputs wait in its ``OutputStream`` (``output_stream.py``) until its
consumer (the worker, then NATS) comes back for them; when it fell behind by several steps, the
outputs it finds are merged per choice into one chunk (frames coalesce rather than queue up one
message per token).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from libs.engine import metrics
from libs.engine.chat import ChatRenderer
from libs.engine.checks import check_prompt, check_prompt_chars
from libs.engine.config import EngineSettings, model_identity
from libs.engine.engine import LLMEngine, StepOutput
from libs.engine.errors import BackendError
from libs.engine.kv_transfer import KvBlocks
from libs.engine.loader import ModelShape
from libs.engine.output_stream import END, OutputStream
from libs.engine.outputs import GenerationChunk, LoadInfo, PreparedPrompt, Resume
from libs.engine.params import ChatMessage, Priority, SamplingParams, Tenant
from libs.engine.tools import ToolSpec

log = logging.getLogger("strait.engine")

# Seconds the idle engine thread sleeps between checks of its stop flag (woken early by work).
IDLE_POLL_S = 0.5


@dataclass(slots=True)
class _Add:
    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    priority: Priority
    resume: Resume | None = None
    grammar: str | None = None
    matchers: list[Any] = field(default_factory=list)  # one per choice, made by prepare
    prediction_ids: list[int] = field(default_factory=list)  # PreparedPrompt.prediction_ids
    # Export the prompt's full blocks on the engine thread the moment the request finishes
    # (before a later step can evict them); delivered as a PrefillResult.
    export: bool = False
    tenant: Tenant | None = None
    lora: str = ""  # PreparedPrompt.lora


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Import:
    kv: KvBlocks
    done: asyncio.Future[int]


@dataclass(slots=True)
class _Call:
    """Run ``fn(engine)`` on the engine thread between steps (LoRA adapter control)."""

    fn: Callable[[LLMEngine], Any]
    done: asyncio.Future[Any]


@dataclass(slots=True)
class PrefillResult:
    """What :meth:`AsyncEngineBackend.prefill` returns: the request's only output chunk (its
    first token, or its end) and the prompt's full KV blocks (None when none is full)."""

    request_id: str
    chunk: GenerationChunk
    kv: KvBlocks | None


class AsyncEngineBackend:
    """Implements :class:`libs.backend.Backend` with :class:`LLMEngine` on its own thread."""

    def __init__(
        self,
        settings: EngineSettings,
        model_path: str,
        model_name: str,
        draft_path: str | None = None,
    ) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.settings = settings
        self.model_path = model_path
        self.draft_path = draft_path  # speculative method "draft": the draft model's directory
        # Told each stage of start() (from its loading thread): the worker announces them.
        self.on_stage: Callable[[str], None] | None = None
        self.model_name = model_name
        self.model_id = model_identity(model_name, settings)
        self.tokenizer: Any = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        config = AutoConfig.from_pretrained(model_path, local_files_only=True)
        text_config = config.get_text_config()
        self.vocab_size: int = text_config.vocab_size
        # The engine's own limit (ModelShape.context_limit: positions, sliding window).
        self.max_model_len: int = ModelShape.of(config).context_limit(settings.max_model_len)
        self.chat = ChatRenderer(self.tokenizer)
        self._engine: LLMEngine | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Import | _Call] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._streams: dict[str, OutputStream] = {}
        # Snapshot for load(), written by the engine thread after each step.
        self._load = LoadInfo(capacity=settings.max_num_seqs, block_size=settings.block_size)
        self._events_lock = threading.Lock()
        self._stored: list[int] = []
        self._evicted: list[int] = []
        self._exports: dict[str, list[int]] = {}  # request id → prompt ids (engine thread only)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Load the model (off the loop) and start the engine thread."""
        if self.settings.num_threads:
            torch.set_num_threads(self.settings.threads())
        log.info("engine threads: %d", torch.get_num_threads())
        self._loop = asyncio.get_running_loop()
        self._engine = await asyncio.to_thread(
            LLMEngine.from_path,
            self.model_path,
            self.settings,
            self.model_id,
            self.draft_path,
            on_stage=self.on_stage,
        )
        self._engine.tokenizer = self.tokenizer
        self._update_load()
        self._thread = threading.Thread(target=self._run, name="strait-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        for q in self._streams.values():
            q.put_nowait(BackendError("internal_error", "the engine stopped"))

    @property
    def num_kv_blocks(self) -> int:
        """Blocks of the whole KV cache (0 before :meth:`start`)."""
        return self._engine.pool.num_blocks if self._engine is not None else 0

    def cached_prefix_blocks(self, block_hashes: list[int]) -> int:
        """Leading ``block_hashes`` this engine's prefix cache holds now. Read from the event
        loop without locking: a block evicted right after is recomputed, never misused."""
        engine = self._engine
        if engine is None:
            return 0
        n = 0
        for h in block_hashes:
            if engine.pool.lookup(h) is None:
                break
            n += 1
        return n

    # ------------------------------------------------------------------ Backend API

    def prepare(
        self,
        *,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        messages: list[ChatMessage] | None,
        sampling: SamplingParams,
        tools: ToolSpec | None = None,
    ) -> PreparedPrompt:
        """Chat template / tokenize, check ids and length, compile the request's grammar.
        Raises BackendError. Called by the workers on a thread off their event loop (it may
        take milliseconds: a long prompt's tokens, a schema's validation)."""
        param = "messages" if messages is not None else "prompt"
        text = ""
        if messages is not None:
            text = self.chat.render(messages, tools)
            self._check_chars(len(text), sampling, param)
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        elif prompt is not None:
            text = prompt
            self._check_chars(len(text), sampling, param)
            ids = list(self.tokenizer(prompt)["input_ids"])
        elif prompt_token_ids is not None:
            ids = list(prompt_token_ids)
        else:
            raise BackendError("invalid_request", "no prompt given", "prompt")
        check_prompt(ids, sampling.max_tokens, self.max_model_len, self.vocab_size, param)
        # logit_bias's token ids are checked by LLMEngine.add_request.
        predicted: list[int] = []
        if sampling.prediction:
            predicted = list(
                self.tokenizer(sampling.prediction, add_special_tokens=False)["input_ids"]
            )
        if sampling.structured is None and not (tools is not None and tools.forced):
            return PreparedPrompt(token_ids=ids, text=text, prediction_ids=predicted)
        grammars = self._engine.grammars if self._engine is not None else None
        if grammars is None:
            raise BackendError("internal_error", "the engine is not started")
        grammar = grammars.compile(sampling.structured, tools)
        matchers = [grammars.matcher(grammar) for _ in range(sampling.n)] if grammar else []
        return PreparedPrompt(
            token_ids=ids, text=text, grammar=grammar, matchers=matchers, prediction_ids=predicted
        )

    def _check_chars(self, chars: int, sampling: SamplingParams, param: str) -> None:
        check_prompt_chars(
            chars, self.chat.max_token_chars, sampling.max_tokens, self.max_model_len, param
        )

    async def generate(
        self,
        request_id: str,
        prompt: PreparedPrompt,
        sampling: SamplingParams,
        priority: Priority,
        resume: Resume | None = None,
        tenant: Tenant | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """Stream chunks until every choice finished; closing early aborts the request.
        ``resume``: the first token was sampled by a prefill worker (KV handoff)."""
        add = _Add(
            request_id,
            list(prompt.token_ids),
            sampling,
            priority,
            resume,
            prompt.grammar,
            list(prompt.matchers),
            list(prompt.prediction_ids),
            tenant=tenant,
            lora=prompt.lora,
        )
        async for item in self._run_request(add):
            assert isinstance(item, StepOutput)
            yield item.chunk

    async def prefill(
        self,
        request_id: str,
        prompt: PreparedPrompt,
        sampling: SamplingParams,
        priority: Priority,
        replayed: list[int] | None = None,
        tenant: Tenant | None = None,
    ) -> PrefillResult:
        """Compute the prompt and sample the first token only (the prefill worker's half of a
        disaggregated request); the prompt's blocks stay in this engine's prefix cache.
        ``replayed``: a migrated request's output streamed elsewhere, computed (and exported)
        with the prompt and replayed before the next token is sampled."""
        replayed = replayed or []
        first = msgspec.structs.replace(
            sampling, max_tokens=min(len(replayed) + 1, sampling.max_tokens)
        )
        add = _Add(
            request_id,
            list(prompt.token_ids),
            first,
            priority,
            resume=Resume(replayed=replayed) if replayed else None,
            grammar=prompt.grammar,
            matchers=list(prompt.matchers[:1]),
            export=True,
            tenant=tenant,
            lora=prompt.lora,
        )
        async for item in self._run_request(add):
            if isinstance(item, PrefillResult):
                return item
        raise BackendError("internal_error", "the prefill ended without output")

    async def import_prefix(self, kv: KvBlocks) -> int:
        """Put handed-off or cached blocks into the prefix cache (on the engine thread); the
        next request with that prefix gets them as hits. Returns the blocks new here."""
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._submit(_Import(kv, done))
        return await done

    async def adapters(self, action: str, name: str = "", path: str = "") -> list[str]:
        """Load, unload or list LoRA adapters on the engine thread (between steps); the
        adapters loaded after. Raises AdapterError (refused), KeyError (not found) or
        BackendError (engine.max_loras = 0)."""

        def call(engine: LLMEngine) -> list[str]:
            slots = engine.loras
            if slots is None:
                raise BackendError("invalid_request", "this engine has no LoRA slots")
            if action == "load":
                slots.load(name, path or None)
            elif action == "unload" and not slots.unload(name):
                raise KeyError(name)
            return slots.loaded()

        done: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        self._submit(_Call(call, done))
        return await done

    async def _run_request(self, add: _Add) -> AsyncIterator[StepOutput | PrefillResult]:
        if self._thread is None:
            raise BackendError("internal_error", "the engine is not started")
        request_id = add.request_id
        if request_id in self._streams:
            raise BackendError("invalid_request", f"request {request_id!r} is already running")
        stream = OutputStream()
        self._streams[request_id] = stream
        self._submit(add)
        done = False
        try:
            while True:
                item = await stream.get()
                if item is END:
                    return
                if isinstance(item, BaseException):
                    done = True  # the engine already dropped it
                    raise item
                if isinstance(item, PrefillResult):
                    done = True
                    yield item
                    return
                out: StepOutput = item
                done = out.request_finished and not add.export
                yield out
                if done:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not done:
                self._submit(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        """Cancel a request: frees its blocks; its ``generate`` iterator ends without finish."""
        self._submit(_Abort(request_id))
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(END)

    def load(self) -> LoadInfo:
        with self._events_lock:
            stored, evicted = self._stored, self._evicted
            self._stored, self._evicted = [], []
        s = self._load
        return LoadInfo(
            running=s.running,
            waiting=s.waiting,
            kv_blocks_used=s.kv_blocks_used,
            kv_blocks_free=s.kv_blocks_free,
            capacity=s.capacity,
            block_size=s.block_size,
            adapters=s.adapters,
            stored_hashes=stored,
            evicted_hashes=evicted,
        )

    # ------------------------------------------------------------------ engine thread

    def _submit(self, cmd: _Add | _Abort | _Import | _Call) -> None:
        self._inbox.put(cmd)
        self._wake.set()

    def _run(self) -> None:
        engine = self._engine
        assert engine is not None
        while not self._stopping:
            self._drain_inbox(engine)
            if not engine.has_unfinished():
                self._wake.wait(IDLE_POLL_S)
                self._wake.clear()
                continue
            started = time.perf_counter()
            try:
                outputs = engine.step()
            except Exception as e:  # a bug or OOM: fail what is running, keep serving
                log.exception("engine step failed")
                self._fail_all(engine, BackendError("internal_error", f"engine step failed: {e}"))
                continue
            kind = "decode" if engine.last_step_decode_only else "mixed"
            metrics.STEP.labels(kind=kind).observe(time.perf_counter() - started)
            self._update_load()
            if outputs:
                self._deliver([self._with_export(engine, out) for out in outputs])

    def _drain_inbox(self, engine: LLMEngine) -> None:
        changed = False
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            changed = True
            if isinstance(cmd, _Abort):
                engine.abort_request(cmd.request_id)
                self._exports.pop(cmd.request_id, None)
                continue
            if isinstance(cmd, _Import):
                self._import(engine, cmd)
                continue
            if isinstance(cmd, _Call):
                self._call(engine, cmd)
                continue
            try:
                engine.add_request(
                    cmd.request_id,
                    cmd.token_ids,
                    cmd.sampling,
                    cmd.priority,
                    cmd.resume,
                    cmd.grammar,
                    cmd.matchers,
                    cmd.prediction_ids,
                    cmd.tenant,
                    lora=cmd.lora,
                )
            except BackendError as e:
                self._deliver_error(cmd.request_id, e)
                continue
            if cmd.export:
                replayed = cmd.resume.replayed if cmd.resume is not None else []
                self._exports[cmd.request_id] = cmd.token_ids + replayed
        if changed:
            self._update_load()

    def _with_export(self, engine: LLMEngine, out: StepOutput) -> StepOutput | PrefillResult:
        """A finished prefill-only request: export its prompt's blocks now, while cached."""
        if not out.request_finished or out.request_id not in self._exports:
            return out
        prompt = self._exports.pop(out.request_id)
        return PrefillResult(out.request_id, out.chunk, engine.export_prefix(prompt))

    def _call(self, engine: LLMEngine, cmd: _Call) -> None:
        assert self._loop is not None
        try:
            result = cmd.fn(engine)
        except Exception as e:  # the caller's to report (an adapter refused, not found)
            self._loop.call_soon_threadsafe(_set_exception, cmd.done, e)
            return
        self._loop.call_soon_threadsafe(_set_result, cmd.done, result)

    def _import(self, engine: LLMEngine, cmd: _Import) -> None:
        assert self._loop is not None
        try:
            n = engine.import_prefix(cmd.kv)
        except ValueError as e:
            err = BackendError("invalid_request", f"KV blocks do not fit this engine: {e}")
            self._loop.call_soon_threadsafe(_set_exception, cmd.done, err)
            return
        self._loop.call_soon_threadsafe(_set_result, cmd.done, n)

    def _fail_all(self, engine: LLMEngine, error: BackendError) -> None:
        for request_id in list(engine.requests):
            engine.abort_request(request_id)
            self._deliver_error(request_id, error)
        self._update_load()

    def _deliver(self, outputs: list[StepOutput | PrefillResult]) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._put_outputs, outputs)

    def _deliver_error(self, request_id: str, error: BackendError) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._put_error, request_id, error)

    def _put_outputs(self, outputs: list[StepOutput | PrefillResult]) -> None:
        """On the event loop: route each output to its request's stream."""
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _put_error(self, request_id: str, error: BackendError) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(error)

    def _update_load(self) -> None:
        engine = self._engine
        if engine is None:
            return
        stored, evicted = engine.drain_kv_events()
        if stored or evicted:
            with self._events_lock:
                self._stored.extend(stored)
                self._evicted.extend(evicted)
        self._load = LoadInfo(
            running=engine.scheduler.num_running,
            waiting=engine.scheduler.num_waiting,
            kv_blocks_used=engine.pool.num_used,
            kv_blocks_free=engine.pool.num_free,
            capacity=self.settings.max_num_seqs,
            block_size=self.settings.block_size,
            step_load=engine.step_load(),
            adapters=engine.loras.loaded() if engine.loras is not None else [],
            forward=engine.runner.forward_kind,
        )


def _set_result(fut: asyncio.Future[Any], n: Any) -> None:
    if not fut.done():
        fut.set_result(n)


def _set_exception(fut: asyncio.Future[Any], e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)
