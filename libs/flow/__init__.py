"""Flow control between tenants sharing the fleet (docs/flow-control.md).

- ``fair``: weighted fair share of tokens served (a virtual token counter per tenant, inside
  priority bands), the order every queue of the fleet serves its waiting requests in;
- ``tenant``: who a request is served as, its weight and band;
- ``labels``: a bounded set of tenant label values for metrics.
"""
