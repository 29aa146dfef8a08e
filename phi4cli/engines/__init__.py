"""Where a request goes and what comes back: ``backends`` (the one Backend interface),
``dispatch`` (the Flight: one request path for one request or thousands, over replicas),
``daemon_link`` (the local daemon over its socket, started when needed), ``remote`` with
``remote_wire``, ``remote_shared`` and ``replicas`` (OpenAI-compatible servers), and
``outcome`` (a request's events folded into its answer)."""
