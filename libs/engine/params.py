"""The engine's request types: what one request asks of the engine, as the engine reads it.

:class:`SamplingParams` (with its :class:`StructuredOutput`), the chat turns of a prompt
(:class:`ChatMessage`, :class:`ToolCall`) and the functions a model may call
(:class:`ToolFunction`), the per-token log-probabilities it reports (:class:`LogprobEntry`), and
the bounds on them. These are ``msgspec`` structs because they also travel: the wire protocol
(``libs/protocol.py``) embeds them in ``GenerateRequest`` and ``TokenDelta`` and re-exports
them, so their JSON is the wire's. The engine imports nothing of the fleet; the gateway and
the protocol translate into these.

Cross-field rules a schema cannot express are in :mod:`libs.engine.checks`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

# Bounds on a request's constraint (characters of a regex or grammar; logit_bias entries).
MAX_GRAMMAR_CHARS = 65_536
# Characters of a request's predicted output (SamplingParams.prediction).
MAX_PREDICTION_CHARS = 262_144
MAX_LOGIT_BIAS = 1024

Priority = Literal["interactive", "batch"]
# "tool_calls": the choice ended with tool calls (TokenDelta.tool_calls), as OpenAI's.
FinishReason = Literal["stop", "length", "abort", "tool_calls"]
ToolChoice = Literal["none", "auto", "required"]


class Struct(msgspec.Struct, forbid_unknown_fields=False):
    """Base for the engine's types: unknown fields are ignored, as the wire's are (forward
    compatible within a protocol version)."""


class ToolCall(Struct, kw_only=True):
    """One function call a model made (or, in a request's history, had made)."""

    id: str
    name: str
    arguments: str  # JSON text of the arguments object


class ChatMessage(Struct):
    role: str  # system | user | assistant | tool
    content: str
    # An assistant turn's calls; a tool turn answers one of them by id.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ToolFunction(Struct, kw_only=True):
    """A function the model may call (OpenAI's ``tools[].function``)."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern="^[A-Za-z0-9_-]+$")]
    description: str = ""
    # A JSON schema of the arguments object.
    parameters: dict[str, Any] = msgspec.field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )


class StructuredOutput(Struct, kw_only=True):
    """A constraint on every choice's output (vLLM's ``structured_outputs``), enforced token by
    token by the worker's grammar engine. Exactly one field is set."""

    json: dict[str, Any] | None = None  # a JSON schema ({"type": "object"}: any JSON object)
    regex: Annotated[str, msgspec.Meta(max_length=MAX_GRAMMAR_CHARS)] | None = None
    choice: Annotated[list[str], msgspec.Meta(min_length=1, max_length=1024)] | None = None
    grammar: Annotated[str, msgspec.Meta(max_length=MAX_GRAMMAR_CHARS)] | None = (
        None  # Lark or GBNF
    )

    @property
    def kind(self) -> str:
        """The one field that is set ("" when none is)."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return ""


class SamplingParams(Struct):
    """What the engine needs to sample one request. Defaults match the OpenAI API's."""

    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 16
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=-1)] = -1  # -1: off
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    seed: int | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=16)] = 1
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    # Number of top alternatives to return per token; None: no log-probabilities.
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    # Token id (as a decimal string, as OpenAI's JSON has it) → bias added to its logit before
    # anything else.
    logit_bias: (
        Annotated[
            dict[
                Annotated[str, msgspec.Meta(pattern="^[0-9]{1,9}$")],
                Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)],
            ],
            msgspec.Meta(max_length=MAX_LOGIT_BIAS),
        ]
        | None
    ) = None
    # A grammar every choice's output must follow (tools with tool_choice required or a named
    # function add their own; see GenerateRequest.tools).
    structured: StructuredOutput | None = None
    # Speculative decoding for this request: at most this many proposed tokens a step (0:
    # none); None: the pool's engine.speculative. A ceiling: it never turns speculation on
    # where the pool has none, and never changes the output, only its speed.
    num_speculative_tokens: Annotated[int, msgspec.Meta(ge=0, le=16)] | None = None
    # OpenAI's predicted output (``prediction.content``): text the answer is expected to
    # repeat, e.g. the code being edited. Speculation proposes from it first (even in a pool
    # with speculation off); like every proposal it changes the speed, never the answer.
    prediction: Annotated[str, msgspec.Meta(max_length=MAX_PREDICTION_CHARS)] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}


class TokenLogprob(Struct):
    token: str
    logprob: float
    token_id: int


class LogprobEntry(Struct):
    token: str
    token_id: int
    logprob: float
    top: list[TokenLogprob] = msgspec.field(default_factory=list)
