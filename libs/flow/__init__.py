"""Flow control between tenants sharing the fleet (docs/flow-control.md).

- ``gate``: seats handed out in fair-share order (the fake backend's admission), by the
  weighted fair share of tokens served (``libs.engine.fair``: a virtual token counter per
  tenant inside priority bands, the order every queue of the fleet serves its waiting requests
  in; it lives in the engine, whose scheduler is its first user, so the engine imports nothing
  of the fleet's);
- ``tenant``: who a request is served as, its weight and band;
- ``labels``: a bounded set of tenant label values for metrics.
"""
