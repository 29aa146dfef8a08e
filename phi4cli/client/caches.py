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
    copy kept (in use) or left alone (a directory that is not private) is said.

    Raise UnwritableError, after the rest is removed, for what could not be (a read-only
    filesystem), saying how much was."""
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
            in_use = {
                path: pid for path, pid in mapped_by(directory).items() if path.suffix == ".gguf"
            }
    failed: list[tuple[Path, OSError]] = []
    staged = remove_staged(in_use=in_use, failed=failed)
    problems = [("staged model copy", path, exc) for path, exc in failed]
    for path, pid in sorted(in_use.items()):
        say(f"kept {path}: in use by pid {pid} (a running daemon: stop it to free that RAM)")
    counts = []
    for name in ("states", "sessions"):
        folder = paths.cache_dir / name
        before = _states(folder)
        try:
            shutil.rmtree(folder)
        except FileNotFoundError:
            pass
        except OSError as exc:  # a read-only filesystem: rmtree stops at the first file
            problems.append(("cache directory", folder, exc))
        counts.append(before - _states(folder))
    if problems:
        from phi4cli.core.atomicfile import UnwritableError

        what, path, error = problems[0]
        raise UnwritableError(
            path,
            what,
            error,
            verb="remove",
            detail=(
                f" (removed {staged} staged model copies, {counts[0]} saved prompt states and "
                f"{counts[1]} swapped-out chat sessions)"
            ),
        )
    return staged, counts[0], counts[1]


def _states(folder: Path) -> int:
    return len(list(folder.glob("*.state"))) if folder.is_dir() else 0
