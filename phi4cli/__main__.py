"""Entry point for ``python -m phi4cli`` (also how the daemon is spawned): as the ``phi4``
command."""

from __future__ import annotations

from phi4cli.entry import main

if __name__ == "__main__":
    main()
