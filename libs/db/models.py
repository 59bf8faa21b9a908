"""Tables: ``api_keys`` (hashed secrets and limits), ``requests`` (the ledger, one row per
request: origin and id), ``responses`` (stored Responses API objects, per key), and the Batch
API's ``files``, ``batches`` and ``batch_results`` (one row per answered line). Changing them needs a new revision in ``migrations/versions``."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    # "scrypt$<n>$<r>$<p>$<salt hex>$<hash hex>" of the whole secret.
    secret_hash: Mapped[str] = mapped_column(String(255))
    rpm: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tpm: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # The team (docs/security.md) the key's requests are billed and limited as.
    team: Mapped[str | None] = mapped_column(String(32), nullable=True)
    # Flow control (docs/flow-control.md): weight in the fair share (None: 1), most requests
    # waiting for a pool (None: flow.max_waiting), best band its requests may use (None: any).
    weight: Mapped[float | None] = mapped_column(Float, nullable=True)
    max_waiting: Mapped[int | None] = mapped_column(Integer, nullable=True)
    priority: Mapped[str | None] = mapped_column(String(16), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class RequestRow(Base):
    """One row a request: (``request_id``, ``origin``) is its key, as in the fleet."""

    __tablename__ = "requests"

    request_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    # The team account the request came in through (GenerateRequest.origin); '' for the
    # fleet's own (the gateway, internal clients). Two teams may use the same request id.
    origin: Mapped[str] = mapped_column(String(32), primary_key=True, server_default="")
    api_key_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # Who sent it, as the fleet knows it: the NATS account's team, or the API key's team.
    team: Mapped[str | None] = mapped_column(String(32), nullable=True)
    pool: Mapped[str] = mapped_column(String(128), default="")
    model: Mapped[str] = mapped_column(Text, default="")
    worker_id: Mapped[str] = mapped_column(String(200), default="")
    route_code: Mapped[str] = mapped_column(String(64), default="")
    route_factors: Mapped[list[str]] = mapped_column(JSON, default=list)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    queued_s: Mapped[float] = mapped_column(Float, default=0.0)
    ttft_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    total_s: Mapped[float] = mapped_column(Float, default=0.0)
    status: Mapped[str] = mapped_column(String(16))
    error_code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    source: Mapped[str] = mapped_column(String(32), default="gateway")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        Index("ix_requests_api_key_id_created_at", "api_key_id", "created_at"),
        Index("ix_requests_created_at", "created_at"),
        Index("ix_requests_team_created_at", "team", "created_at"),
    )


class StoredResponse(Base):
    """A response of ``POST /v1/responses`` kept for ``GET`` and ``previous_response_id``
    (``store``), visible only to the API key that created it."""

    __tablename__ = "responses"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    # None: the gateway's anonymous caller (auth off).
    api_key_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # The Response object as returned.
    body: Mapped[dict[str, Any]] = mapped_column(JSON)
    # The conversation it ends, as chat messages (libs.protocol.ChatMessage, without the
    # request's instructions, which a follow-up does not inherit), its own output last.
    history: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    # A background response while it runs: the gateway process running it, and until when that
    # gateway has said it still does (services.gateway.background; None for the others).
    owner: Mapped[str | None] = mapped_column(String(64), nullable=True)
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    __table_args__ = (
        Index("ix_responses_api_key_id_created_at", "api_key_id", "created_at"),
        Index("ix_responses_lease_until", "lease_until"),
    )


class StoredFile(Base):
    """A file of the Files API: a batch's input (``purpose`` "batch") or its output or error
    file (``batch_output``), visible only to the API key that owns it."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    api_key_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(255))
    size: Mapped[int] = mapped_column("bytes", Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    content: Mapped[bytes] = mapped_column(LargeBinary)

    __table_args__ = (Index("ix_files_api_key_id_created_at", "api_key_id", "created_at"),)


class BatchRow(Base):
    """A batch of ``POST /v1/batches``: its state, counts and files. ``status`` moves
    validating → in_progress → finalizing → completed (or failed, cancelling → cancelled,
    expired); the counts are written in the transaction that adds a ``batch_results`` row."""

    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    api_key_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    team: Mapped[str | None] = mapped_column(String(32), nullable=True)
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    output_file_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # OpenAI's batch object fields not derived from the above: metadata, errors and the
    # timestamps (unix seconds) of each status reached.
    body: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))

    __table_args__ = (Index("ix_batches_api_key_id_created_at", "api_key_id", "created_at"),)


class BatchResult(Base):
    """The answer to one line: its output (or error) file line. The primary key is what makes
    a line answered once whatever is redelivered."""

    __tablename__ = "batch_results"

    batch_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    line: Mapped[int] = mapped_column(Integer, primary_key=True)
    ok: Mapped[bool] = mapped_column(Boolean)
    result: Mapped[dict[str, Any]] = mapped_column(JSON)
