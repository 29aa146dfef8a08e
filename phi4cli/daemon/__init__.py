"""The resident daemon: ``server`` (the socket, clients, lifecycle), ``scheduler`` and ``jobs``
(requests waiting for the engine), ``memory`` (the memory plan), ``llama/`` (the batching engine:
the only package that imports llama_cpp), ``ramdisk`` and ``statefile``. (A client starts a
daemon with ``backends.spawn``.)"""
