"""The harness the benches and the test suite share: a nats-server of their own and isolated
settings (``services``), the fleet in one event loop (``fleet``) or as processes (``procs``), a
secured nats-server (``secure``), tiny random-weight models (``tiny_models``).

It lives under ``bench/`` because it assembles services (workers, router, gateway) into fleets:
``libs`` never imports ``services``, and the benches, which are packaged, may not import
``tests/``, which is not. The tests import it from here.
"""
