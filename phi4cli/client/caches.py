"""What ``phi4 cache clear`` removes: the staged model copies in RAM (but one a running daemon of
any install has loaded), the saved system-prompt states and the swapped-out chat sessions."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from phi4cli.client.exits import Announce
from phi4cli.core.paths import Paths, not_private


def clear_caches(paths: Paths, say: Announce) -> tuple[int, int, int]:
    """Remove them; return how many staged copies, prompt states and chat sessions went. Each
    copy kept (in use) or left alone (a directory that is not private) is said."""
    from phi4cli.daemon.ramdisk import mapped_by, ramdisk_dir, remove_staged

    directory = ramdisk_dir()
    in_use: dict[Path, int] = {}
    if directory is not None and os.path.lexists(directory):
        problem = not_private(directory)
        if problem is not None:
            say(f"staged copies left alone: {problem}")
        elif directory.is_dir():
            # The staging dir is the user's, shared by every install (PHI4_HOME): a copy that a
            # running daemon has loaded stays, or its RAM would stay taken and the file gone.
            in_use = {path: pid for path, pid in mapped_by(directory).items()
                      if path.suffix == ".gguf"}  # fmt: skip
    staged = remove_staged(in_use=in_use)
    for path, pid in sorted(in_use.items()):
        say(f"kept {path}: in use by pid {pid} (a running daemon: stop it to free that RAM)")
    counts = []
    for name in ("states", "sessions"):
        folder = paths.cache_dir / name
        counts.append(len(list(folder.glob("*.state"))) if folder.is_dir() else 0)
        shutil.rmtree(folder, ignore_errors=True)
    return staged, counts[0], counts[1]
