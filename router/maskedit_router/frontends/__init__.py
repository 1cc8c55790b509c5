"""The HTTP frontends: the router's HTTP port (``http_port``: ``/metrics``, ``/health`` and Triton's HTTP/REST
protocol, ``kserve_http``), the OpenAI API (``openai_api`` over ``openai_form`` and ``openai_errors``), adapter
administration (``lora_admin``) and clients that go away (``client_gone``).

Each edit goes to the router's own gRPC port over loopback, so it gets exactly the proxy's routing, retries and
admission: nothing here imports the proxy or placement (``.importlinter``)."""
