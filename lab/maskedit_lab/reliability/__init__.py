"""The service under faults and load past its capacity, judged by what every request ended in: ``chaos`` (processes
killed, stopped and restarted), ``faults`` (storage, router and process faults, recovery to ``full_strength``),
``fault_streams`` (idle streams from a client that dies), ``overload`` (twice capacity, and a flood at one server),
``soak`` (a long run at the knee, watching memory), ``tenant_fairness`` (one tenant's flood beside light tenants);
``capacity`` finds the rates they run at and ``report`` prints docs/reliability.md's tables from their results.
They drive ``topology`` (supervised Triton instances and the router as its own process, stopped and checked for
leftovers with ``footprint``) with the load generator (``loadgen``: workload, runner, records)."""
