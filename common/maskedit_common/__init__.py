"""What the serving backend (``maskedit``) and the router (``maskedit_router``) share, and nothing else.

- ``settings``: the one ``Settings`` object that reads every ``MASKEDIT_*`` variable (and where cost profiles are);
- ``cost_model``: the profiled latency model the engine's planner and the router predict with; ``blocks``: the
  block modes and per-block costs it speaks in; ``flops``: the FLOP model behind its fallback;
- ``heal``: the pure rules of an entry's invalid tokens and of healing them (the engine and the router's
  simulator apply the same ones);
- ``logs``: the JSON-lines log format of every service;
- ``wire``: how an image arrives on the wire (raw or base64).

Plain Python and numpy: no torch, Triton or gRPC at import time, so the router can depend on it without the
backend. An import-linter contract (``.importlinter``) keeps it from importing either side.
"""
