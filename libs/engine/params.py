"""The engine's request types: what one request asks of the engine, as the engine reads it.

:class:`SamplingParams` (with its :class:`StructuredOutput`), the chat turns of a prompt
(:class:`ChatMessage`, :class:`ToolCall`) and the functions a model may call
(:class:`ToolFunction`), the per-token log-probabilities it reports (:class:`LogprobEntry`), and
the bounds on them. These are ``msgspec`` structs because they also travel: the wire protocol
(``libs/protocol/``) embeds them in ``GenerateRequest`` and ``TokenDelta`` and re-exports
them, so their JSON is the wire's. The engine imports nothing of the fleet; the gateway and
the protocol translate into these.

Cross-field rules a schema cannot express are in :mod:`libs.engine.checks`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypedDict

import msgspec


class Bound(TypedDict, total=False):
    """A number's bounds, as ``msgspec.Meta`` and pydantic's ``Field`` both take them."""

    ge: float
    gt: float
    le: float


# The bounds on a request's fields, each written once: the structs below read them, and so do
# the gateway's HTTP bodies (services/gateway/schemas.py, responses.py), so an HTTP request and
# a NATS one are held to the same numbers. (An int bound stays an int: it is in the schemas.)
BOUNDS: dict[str, Bound] = {
    "max_tokens": {"ge": 1},
    "temperature": {"ge": 0.0, "le": 2.0},
    "top_p": {"gt": 0.0, "le": 1.0},
    "top_k": {"ge": -1},
    "min_p": {"ge": 0.0, "le": 1.0},
    "presence_penalty": {"ge": -2.0, "le": 2.0},
    "frequency_penalty": {"ge": -2.0, "le": 2.0},
    "repetition_penalty": {"gt": 0.0},
    "n": {"ge": 1, "le": 16},
    "logprobs": {"ge": 0, "le": 20},
    "num_speculative_tokens": {"ge": 0, "le": 16},
}
# A logit_bias entry: a token id (decimal, as OpenAI's JSON has it) → a bias in these bounds.
LOGIT_BIAS_KEY = "^[0-9]{1,9}$"
LOGIT_BIAS_VALUE: Bound = {"ge": -100.0, "le": 100.0}
MAX_LOGIT_BIAS = 1024
# Bounds on a request's constraint (characters of a regex or grammar; options of a choice).
MAX_GRAMMAR_CHARS = 65_536
MAX_CHOICES = 1024
# Characters of a request's predicted output (SamplingParams.prediction).
MAX_PREDICTION_CHARS = 262_144
# A function's name: 1 to MAX_TOOL_NAME of these characters.
TOOL_NAME_CHARS = "A-Za-z0-9_-"
MAX_TOOL_NAME = 64

# A request's band: every queue serves interactive, then standard, then batch requests
# (docs/flow-control.md); a tenant's entry caps the band it may use.
Priority = Literal["interactive", "standard", "batch"]
PRIORITY_BANDS: tuple[Priority, ...] = ("interactive", "standard", "batch")  # best first


class Tenant(msgspec.Struct, frozen=True):
    """Who a request is served as in the engine's fair share of tokens (libs/engine/fair.py)
    and its weight there; the fleet names it (libs/flow/tenant.py)."""

    name: str = ""
    weight: float = 1.0


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

    name: Annotated[
        str,
        msgspec.Meta(min_length=1, max_length=MAX_TOOL_NAME, pattern=f"^[{TOOL_NAME_CHARS}]+$"),
    ]
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
    choice: Annotated[list[str], msgspec.Meta(min_length=1, max_length=MAX_CHOICES)] | None = None
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

    max_tokens: Annotated[int, msgspec.Meta(**BOUNDS["max_tokens"])] = 16
    temperature: Annotated[float, msgspec.Meta(**BOUNDS["temperature"])] = 1.0
    top_p: Annotated[float, msgspec.Meta(**BOUNDS["top_p"])] = 1.0
    top_k: Annotated[int, msgspec.Meta(**BOUNDS["top_k"])] = -1  # -1: off
    min_p: Annotated[float, msgspec.Meta(**BOUNDS["min_p"])] = 0.0
    presence_penalty: Annotated[float, msgspec.Meta(**BOUNDS["presence_penalty"])] = 0.0
    frequency_penalty: Annotated[float, msgspec.Meta(**BOUNDS["frequency_penalty"])] = 0.0
    repetition_penalty: Annotated[float, msgspec.Meta(**BOUNDS["repetition_penalty"])] = 1.0
    seed: int | None = None
    n: Annotated[int, msgspec.Meta(**BOUNDS["n"])] = 1
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    # Number of top alternatives to return per token; None: no log-probabilities.
    logprobs: Annotated[int, msgspec.Meta(**BOUNDS["logprobs"])] | None = None
    # Token id (as a decimal string, as OpenAI's JSON has it) → bias added to its logit before
    # anything else.
    logit_bias: (
        Annotated[
            dict[
                Annotated[str, msgspec.Meta(pattern=LOGIT_BIAS_KEY)],
                Annotated[float, msgspec.Meta(**LOGIT_BIAS_VALUE)],
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
    num_speculative_tokens: (
        Annotated[int, msgspec.Meta(**BOUNDS["num_speculative_tokens"])] | None
    ) = None
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
