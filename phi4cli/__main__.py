"""Entry point for ``python -m phi4cli`` (also how the daemon is spawned): as the ``phi4``
script, through the thin client (``phi4cli.thin``)."""

from __future__ import annotations

from phi4cli.thin import main

if __name__ == "__main__":
    main()
