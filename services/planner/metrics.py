"""Prometheus metrics of the planner process."""

from prometheus_client import Counter, Gauge

REPLICAS = Gauge("strait_planner_replicas", "Workers the planner wants", ["pool", "role"])
CURRENT = Gauge("strait_planner_current", "Live, not draining workers seen", ["pool", "role"])
FORECAST = Gauge(
    "strait_planner_forecast_rps", "Forecast peak arrivals a second over the horizon", ["pool"]
)
ARRIVALS = Gauge("strait_planner_arrivals_rps", "Arrivals a second, last bucket", ["pool"])
DECISIONS = Counter(
    "strait_planner_decisions_total", "Decisions by reason", ["pool", "role", "reason"]
)
