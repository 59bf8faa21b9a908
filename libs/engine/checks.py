"""The one check of a request's inputs: every rule a request must pass, each written once.

Two kinds of rule, called from every path a request takes:

- :func:`check_request`, the rules across fields that a schema cannot express (one prompt form,
  one structured-output kind, tools to choose from). Needs no model: the wire protocol runs it
  on every ``GenerateRequest`` (``libs.protocol.validate_request``: the router, the workers,
  the Python client before sending) and the gateway runs it on the request it translated from
  an HTTP body.
- :func:`check_prompt` (the prompt's tokens against the vocabulary and the context),
  :func:`check_prompt_chars` (its text before tokenizing), :func:`check_logit_bias` and
  :func:`check_kv_fits`: the rules that need the model. The backends' ``prepare`` run them
  (``AsyncEngineBackend`` and the fake backend), and ``LLMEngine.add_request``, which tests and
  benchmarks call directly, runs the same ones.

Each raises :class:`~libs.engine.errors.BackendError` naming the field at fault as the
engine's types name it: ``prompt``, ``prompt_token_ids``, ``messages``, ``tools``,
``tool_choice``, ``tool_name``, a :class:`~libs.engine.params.SamplingParams` field (``n``,
``logit_bias``, ``structured``, ``structured.<kind>``). The gateway maps these names to the
OpenAI fields a client sent (``services/gateway/fields.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from libs.engine.errors import BackendError
from libs.engine.params import ChatMessage, SamplingParams, StructuredOutput, ToolFunction

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")


def check_request(
    *,
    prompt: str | None,
    prompt_token_ids: Sequence[int] | None,
    messages: Sequence[ChatMessage] | None,
    sampling: SamplingParams,
    tools: Sequence[ToolFunction] | None = None,
    tool_choice: str = "auto",
    tool_name: str | None = None,
) -> None:
    """The rules across a request's fields (no model needed). Raises BackendError
    (``invalid_request``)."""
    if sum(x is not None for x in (prompt, prompt_token_ids, messages)) != 1:
        raise BackendError(
            "invalid_request", "exactly one of prompt, prompt_token_ids, messages must be set"
        )
    if messages is not None and not messages:
        raise BackendError("invalid_request", "messages must not be empty", "messages")
    check_structured(sampling.structured)
    names = [t.name for t in tools or []]
    if len(set(names)) != len(names):
        raise BackendError("invalid_request", "tools must have distinct names", "tools")
    if (tool_choice == "required" or tool_name is not None) and not names:
        raise BackendError(
            "invalid_request", "tool_choice needs tools to choose from", "tool_choice"
        )
    if tool_name is not None and tool_name not in names:
        raise BackendError(
            "invalid_request", f"tool_name {tool_name!r} is not one of tools", "tool_name"
        )


def check_structured(structured: StructuredOutput | None) -> None:
    """A structured output sets exactly one of its kinds (None: no constraint)."""
    if structured is None:
        return
    if sum(getattr(structured, kind) is not None for kind in STRUCTURED_KINDS) != 1:
        raise BackendError(
            "invalid_request",
            "the structured output must set exactly one of " + ", ".join(STRUCTURED_KINDS),
            "structured",
        )


def check_prompt(
    ids: Sequence[int], max_tokens: int, max_model_len: int, vocab_size: int, param: str
) -> None:
    """The prompt's token ids: not empty, every id in ``0..vocab_size-1``, and the prompt plus
    ``max_tokens`` within ``max_model_len`` tokens. ``param``: the field the prompt came in
    (``prompt``, ``messages``; ``prompt_token_ids`` for an id outside the vocabulary)."""
    if not ids:
        raise BackendError("invalid_request", "the prompt is empty", param)
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise BackendError(
            "invalid_request",
            f"prompt token id {bad} is outside the vocabulary (0..{vocab_size - 1})",
            "prompt_token_ids",
        )
    if len(ids) + max_tokens > max_model_len:
        raise BackendError(
            "context_length_exceeded",
            f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"context ({max_model_len} tokens)",
            param,
        )


def check_prompt_chars(
    chars: int, max_token_chars: int, max_tokens: int, max_model_len: int, param: str
) -> None:
    """Refuse a prompt text that cannot fit the context whatever its tokens, before a tokenizer
    spends time on it: a token spans at most ``max_token_chars`` characters, so ``chars``
    characters are at least ``chars // max_token_chars`` tokens."""
    at_least = chars // max_token_chars
    if at_least + max_tokens > max_model_len:
        raise BackendError(
            "context_length_exceeded",
            f"the prompt ({chars} characters, at least {at_least} tokens) + max_tokens "
            f"({max_tokens}) exceeds the model's context ({max_model_len} tokens)",
            param,
        )


def check_logit_bias(sampling: SamplingParams, vocab_size: int) -> None:
    """Every token ``logit_bias`` names is in the vocabulary."""
    if not all(0 <= t < vocab_size for t in sampling.logit_bias_ids()):
        raise BackendError(
            "invalid_request",
            f"logit_bias names a token outside 0..{vocab_size - 1}",
            "logit_bias",
        )


def check_kv_fits(num_tokens: int, block_size: int, num_blocks: int) -> None:
    """A request's prompt + ``max_tokens`` (``num_tokens``) fits the whole KV cache
    (``num_blocks`` blocks of ``block_size`` tokens): else it could never run."""
    blocks = -(-num_tokens // block_size)  # rounded up
    if blocks > num_blocks:
        raise BackendError(
            "context_length_exceeded",
            f"prompt + max_tokens ({num_tokens} tokens) exceed the KV cache "
            f"({num_blocks * block_size} tokens); raise engine.kv_cache_bytes",
            "prompt",
        )
