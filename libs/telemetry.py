"""OpenTelemetry set-up and W3C trace-context propagation through NATS headers.

``setup_tracing(service)`` is called once by each service's entry function. The exporter is
configured only by the standard ``OTEL_*`` variables: with ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) set, spans go by OTLP/HTTP; otherwise nothing is exported.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

_configured = False


def setup_tracing(service: str, namespace: str = "strait") -> None:
    global _configured
    if _configured:
        return
    _configured = True
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if not endpoint or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    name = os.environ.get("OTEL_SERVICE_NAME", f"strait-{service}")
    provider = TracerProvider(
        resource=Resource.create({"service.name": name, "service.namespace": namespace})
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)


def shutdown_tracing() -> None:
    provider = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)
    if callable(shutdown):
        shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Headers carrying the current span's ``traceparent`` (and ``tracestate``)."""
    carrier: dict[str, str] = dict(headers or {})
    propagate.inject(carrier)
    return carrier


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The remote parent context from a NATS message's headers (empty when none)."""
    return propagate.extract(dict(headers or {}))
