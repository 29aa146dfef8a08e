"""The terminal client: the commands (``cli``, ``cli_options``), ``solving`` and ``grading``
(solve and eval), ``problems`` and ``progress``, the chat (``repl``, ``chats``), what is shown
(``render``), the ``environment`` and ``exits``, completions, and the small commands'
rooms (``service``, ``logfile``, ``caches``, ``config_writing``)."""
