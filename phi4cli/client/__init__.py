"""The terminal client: the commands (``cli``, ``cli_daemon``, ``cli_env``, ``cli_options``),
solving (``solving``, ``solve_job``, ``voting``), eval (``grading``, ``eval_problems``,
``eval_results``), ``problems`` and ``progress``, the chat (``repl``, ``chat_commands``,
``chats``), what is shown (``presenters``, ``render``), the ``environment`` and ``exits``,
completions, and the small commands' rooms (``service``, ``logfile``, ``caches``,
``config_writing``)."""
