"""The gRPC proxy: Triton's own protocol in front of the backends (``server.Router``, served by ``aio``), a client
stream through it (``stream_session``), each backend as the router sees it (``backend``), their health
(``health``), admission in front of their checks (``admission``), the router noticing it was stopped (``stall``),
the calls forwarded as they are (``forwarded_calls``) and where the backends are (``discovery``).

It places requests with ``placement`` and checks callers with ``access``; nothing here imports a frontend or the
endpoint picker (``.importlinter``)."""
