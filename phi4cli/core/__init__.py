"""The shared core every room stands on: the wire ``protocol`` and its typed request, the table
of settings (``options``, and ``_settings`` generated from it), ``config``, ``errors``, the
``paths`` phi4 keeps, ``models`` (aliases and files), ``inputs`` (text checked before it is
sent), ``atomicfile``, ``machine`` facts and the small ``records`` and ``durations``. Nothing
here imports a room above it."""
