"""Access: who may call and how much. API keys and roles (``auth``), TLS (``tls``), per-key limits and the fair
queue between tenants (``tenancy``), the bounds on streams and HTTP connections (``limits``). Every port of the
router checks callers through these; they import nothing else of the router (``.importlinter``)."""
