"""Structured outputs with llguidance: a request's constraint as a grammar, a matcher per
choice, and the allowed-token mask of the rows that carry one.

Who calls what, and on which thread:

- :meth:`Grammars.compile` — the worker's ``prepare`` (``AsyncEngineBackend``), on a thread
  off the worker's event loop: the constraint (``SamplingParams.structured`` and a forced tool
  call) becomes llguidance grammar text, validated against the tokenizer, or a
  ``BackendError(invalid_request, param=...)`` before the request is queued. Cached by the
  grammar text. llguidance compiles lazily inside the matcher, so nothing here holds a step.
- :meth:`Grammars.matcher` — ``LLMEngine`` for each choice (engine thread): a fresh matcher.
- :func:`mask_rows` — the ``Sampler``, on the rows whose sequence has a matcher: disallowed
  tokens' logits become -inf before penalties, temperature and top-k/p.
- ``LLMEngine._append`` advances a choice's matcher with each token (sampled, resumed after a
  handoff, or recomputed after a preemption: the matcher follows ``token_ids``, not the KV).

llguidance was measured against xgrammar on this CPU (``../shared/ENGINE-NOTES.md``,
``docs/decisions/0010-llguidance.md``).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from libs.engine import metrics
from libs.engine.config import StructuredSettings
from libs.engine.errors import BackendError
from libs.engine.json_schema import ascii_regex
from libs.engine.params import StructuredOutput
from libs.engine.tools import ToolSpec, forced_calls_lark, with_layout

# Compiled (validated) grammars kept per worker, by grammar text.
GRAMMAR_CACHE_ENTRIES = 256


def grammar_text(
    structured: StructuredOutput | None,
    tools: ToolSpec | None,
    rules: StructuredSettings | None = None,
) -> str | None:
    """llguidance grammar text of a request's constraint; None when it has none. Schemas and
    regexes are read by ``rules`` (``engine.structured``: closed objects, bounded numbers,
    ASCII classes; :mod:`libs.engine.json_schema`).

    Raises ``BackendError(invalid_request)`` for a grammar llguidance cannot read (e.g. GBNF
    that does not parse). A forced tool call and a JSON schema together: either calls or JSON.
    """
    import llguidance

    rules = rules or StructuredSettings()
    forced = tools is not None and tools.forced
    if structured is None or not structured.kind:
        if not forced:
            return None
        assert tools is not None
        return llguidance.grammar_from("lark", forced_calls_lark(tools, rules))
    kind = structured.kind
    param = f"structured.{kind}"
    try:
        if kind == "json":
            assert structured.json is not None
            if forced:
                assert tools is not None
                return llguidance.grammar_from(
                    "lark", forced_calls_lark(tools, rules, structured.json)
                )
            schema = with_layout(structured.json, rules)
            return llguidance.grammar_from("json_schema", json.dumps(schema))
        if forced:
            assert tools is not None
            raise BackendError(
                "invalid_request",
                f"tool_choice {tools.name or tools.choice!r} cannot be combined with {kind}",
                "tool_choice",
            )
        if kind == "regex":
            regex = structured.regex or ""
            if not rules.ascii_classes:
                return llguidance.grammar_from("regex", regex)
            # A Lark terminal: the only way to hand llguidance a regex with ASCII classes.
            return llguidance.grammar_from("lark", f"start: /{ascii_regex(regex, rules)}/")
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(structured.choice))
        return llguidance.grammar_from("grammar", structured.grammar or "")
    except ValueError as e:
        raise BackendError("invalid_request", f"invalid {kind}: {e}", param) from None


class Grammars:
    """One per engine: the llguidance tokenizer (built on first use, ~0.4–1 s) and a cache of
    validated grammars. Thread-safe: ``compile`` runs on worker threads, ``matcher`` on the
    engine thread."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        rules: StructuredSettings | None = None,
    ) -> None:
        self._hf = tokenizer
        self.rules = rules or StructuredSettings()
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._lock = threading.Lock()
        self._ll: Any = None
        self._valid: OrderedDict[str, None] = OrderedDict()

    @property
    def tokenizer(self) -> Any:
        with self._lock:
            if self._ll is None:
                import llguidance.hf

                self._ll = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self.vocab_size, eos_token=self._eos or None
                )
            return self._ll

    def compile(self, structured: StructuredOutput | None, tools: ToolSpec | None) -> str | None:
        """Validated grammar text for a request, or None. Raises BackendError(invalid_request)."""
        started = time.perf_counter()
        text = grammar_text(structured, tools, self.rules)
        if text is None:
            return None
        with self._lock:
            if text in self._valid:
                self._valid.move_to_end(text)
                metrics.GRAMMAR_COMPILE.labels(result="hit").observe(time.perf_counter() - started)
                return text
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            kind = structured.kind if structured is not None and structured.kind else "tools"
            param = "tools" if kind == "tools" else f"structured.{kind}"
            raise BackendError("invalid_request", f"invalid {kind}: {error.strip()}", param)
        with self._lock:
            self._valid[text] = None
            while len(self._valid) > GRAMMAR_CACHE_ENTRIES:
                self._valid.popitem(last=False)
        metrics.GRAMMAR_COMPILE.labels(result="miss").observe(time.perf_counter() - started)
        return text

    def matcher(self, grammar: str) -> Any:
        """A matcher at the start of ``grammar`` (one per choice)."""
        import llguidance

        return llguidance.LLMatcher(self.tokenizer, grammar)


# Bit b of bitmask word w stands for token 32 * w + b.
_BIT = torch.arange(32, dtype=torch.int32)

MaskKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def mask_rows(
    logits: torch.Tensor,
    rows: Sequence[int],
    matchers: Sequence[Any],
    kernel: MaskKernel | None = None,
) -> None:
    """Set to -inf, in place, the logits of tokens ``matchers[j]`` does not allow next in row
    ``rows[j]``. ``logits``: float32 [S, V], on the CPU or a device (the bitmask, filled on the
    host, is copied there). ``kernel``: the CPU kernels' ``mask_rows`` for CPU logits (0.1 ms
    for 32 rows of 49,152 here); None: torch ops that unpack the bits (~4 ms on 2 cores). llguidance's own ``apply_token_bitmask_inplace`` is a ``torch.compile``d function
    (seconds of compiling at its first call in each process, then ~0.4 ms; on CUDA a Triton
    kernel): not on this path."""
    import llguidance.torch as llt

    started = time.perf_counter()
    try:
        bitmask = llt.allocate_token_bitmask(len(rows), logits.shape[1])  # int32 [R, ceil(V/32)]
        for j, m in enumerate(matchers):
            llt.fill_next_token_bitmask(m, bitmask, j)
        index = torch.tensor(list(rows), dtype=torch.long)
        if kernel is not None and logits.is_contiguous() and logits.device.type == "cpu":
            kernel(logits, index, bitmask)
        else:
            dev = logits.device
            bitmask, index = bitmask.to(dev), index.to(dev)
            bits = ((bitmask.unsqueeze(-1) >> _BIT.to(dev)) & 1).flatten(1)
            allowed = bits[:, : logits.shape[1]]
            sub = logits.index_select(0, index)
            sub.masked_fill_(allowed == 0, float("-inf"))
            logits.index_copy_(0, index, sub)
    finally:
        metrics.GRAMMAR_MASK.observe(time.perf_counter() - started)
        metrics.CONSTRAINED_ROWS.observe(len(rows))
