"""HTTP request bodies of the OpenAI-compatible API, and their mapping to wire messages.

Unknown fields are accepted and ignored (as OpenAI does). Invalid values raise
``ApiError(400, param=...)`` through FastAPI's validation handler in ``errors.py``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from libs.protocol import ChatMessage, SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    # Strait extension: scheduling class.
    priority: Literal["interactive", "batch"] = "interactive"
    # Extensions vLLM users pass: generate past EOS (benchmarks), and extra stop token ids.
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=64)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    def output_limit(self) -> int | None:
        return self.max_tokens

    def sampling(self, default_max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.output_limit() or default_max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            seed=self.seed,
            n=self.n,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def wire_messages(self) -> list[ChatMessage]:
        return [
            ChatMessage(role="system" if m.role == "developer" else m.role, content=m.text())
            for m in self.messages
        ]

    def logprobs_n(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] = Field()
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and isinstance(v[0], str) and len(v) != 1:
            raise ValueError("a batch of prompts is not supported; send one prompt per request")
        return v

    def logprobs_n(self) -> int | None:
        return self.logprobs
