"""``strait up``: the whole fleet on one machine, in the foreground (``main.up``).

- ``main.py``: the order of a start (state dir → NATS → models → database and development key →
  the fleet's processes), readiness, and the loop that watches until Ctrl-C;
- ``fleet.py``: the process table: which processes a settings file asks for, their
  environment, the planner's starts and drains, stopping them all;
- ``children.py``: one supervised process and its restart policy (``supervisor.*``);
- ``nats_server.py``: the local ``nats-server`` reused or started (``--secure``: the fleet's own,
  with TLS and an account per team).
"""
