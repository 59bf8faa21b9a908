"""Python client of Strait's NATS API for internal teams (docs/nats-api.md).

async with StraitClient("nats://...", api_key_id="team-x") as client:
    async with client.generate("Hello", max_tokens=32) as gen:
        async for delta in gen:
            print(delta.text, end="")
    print(gen.usage)
    done = await client.complete(messages=[{"role": "user", "content": "Hi"}])
    async for ev in client.observe("usage", durable="team-x"):
        ...
"""

from libs.client.client import Completion, Generation, RequestOptions, StraitClient
from libs.client.errors import (
    ERROR_CLASSES,
    Cancelled,
    ContextLengthExceeded,
    DeadlineExceeded,
    FleetUnavailable,
    IncompleteStream,
    InternalError,
    InvalidRequest,
    ModelNotFound,
    NoCapacity,
    NoWorker,
    OverShare,
    PayloadTooLarge,
    PermissionDenied,
    RateLimited,
    Retryable,
    StraitError,
    Timeout,
    UnsupportedVersion,
    WorkerLost,
    error_from_message,
)
from libs.client.observe import Observer
from libs.client.respond import Response, ResponseOptions

__all__ = [
    "ERROR_CLASSES",
    "Cancelled",
    "Completion",
    "ContextLengthExceeded",
    "DeadlineExceeded",
    "FleetUnavailable",
    "Generation",
    "IncompleteStream",
    "InternalError",
    "InvalidRequest",
    "ModelNotFound",
    "NoCapacity",
    "NoWorker",
    "Observer",
    "OverShare",
    "PayloadTooLarge",
    "PermissionDenied",
    "RateLimited",
    "RequestOptions",
    "Response",
    "ResponseOptions",
    "Retryable",
    "StraitClient",
    "StraitError",
    "Timeout",
    "UnsupportedVersion",
    "WorkerLost",
    "error_from_message",
]
