"""The planner: forecasts each pool's arrivals and publishes the workers it needs
(docs/planner.md)."""
