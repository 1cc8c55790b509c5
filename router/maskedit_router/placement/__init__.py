"""Placement: where an edit should go. What the router reads from a request (``features``), its books on each
backend (``books``, ``booking``, ``adapter_residency``), the predicted latency (``estimator``) and the routing
policies over them (``policies``).

Pure bookkeeping and arithmetic, no I/O: the router, the endpoint picker and the lab's simulator
(``maskedit_lab.routing``) place through this same code. It imports nothing else of the router (``.importlinter``)."""
