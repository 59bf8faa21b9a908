"""Runnable examples of Strait's NATS API (docs/nats-api.md); each has `run()` and `main()`."""
