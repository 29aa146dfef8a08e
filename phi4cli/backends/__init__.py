"""Where a request goes and what comes back: ``backend`` (the one Backend interface and
``make_backend``), ``dispatch`` and ``flight`` (the Flight: one request path for one request or
thousands, over replicas), the local daemon (``daemon``, over ``daemon_link``, started by
``spawn``), remote OpenAI-compatible servers (``remote_backend``, ``remote`` with ``remote_wire``,
``remote_shared`` and ``replicas``), and ``outcome`` (a request's events folded into its
answer)."""
