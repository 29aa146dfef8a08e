"""The file format of saved KV states (swapped-out chats, the prefilled system prompt), and
reading and writing them so that llama.cpp is only ever handed bytes phi4 wrote itself.

llama.cpp does not validate a sequence state it is given: a truncated or altered one can fail an
assertion and abort the whole daemon, or be loaded as if good and continue the conversation from
garbage. So every state file carries a header that says what it was made for and how long and
what exactly its payload is, and a restore checks all of it before a byte reaches llama.cpp:

    MAGIC (8 bytes) | format version (u32 le) | header length (u32 le) | header (JSON, UTF-8)
    | CRC-32 of the header (u32 le) | the tokens (int32 le each) | payload (llama.cpp's bytes)

The header holds the writer's identity (llama.cpp build, model file, context and KV layout; see
``LoadedModel.state_identity``), the token count and their CRC, and the payload's length and CRC.
A file whose identity, tokens, length or checksums differ from what the reader expects is refused
with :class:`StateFileError`, whose message says why in a few words.

No llama_cpp here: the codec is plain bytes, unit-tested on its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import struct
import sys
import tempfile
import zlib
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

MAGIC = b"PHI4KVS\x00"
FORMAT_VERSION = 1
# A header is a few hundred bytes; a bound keeps a damaged length from asking for gigabytes.
MAX_HEADER_BYTES = 64 << 10
_PREAMBLE = struct.Struct("<8sII")  # magic, format version, header length
_CRC = struct.Struct("<I")
_TOKEN_BYTES = 4

Identity = Mapping[str, str | int | bool]


class StateFileError(Exception):
    """A state file that must not be restored; the message says why (for the daemon log)."""


class StateDirError(StateFileError):
    """The directory of state files is not a private one of ours: nothing in it is read,
    written or removed."""


def _token_bytes(tokens: Sequence[int]) -> bytes:
    packed = array("i", tokens)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def encode_header(identity: Identity, tokens: Sequence[int], payload: Any) -> bytes:
    """Return everything of a state file before its payload: preamble, header, its CRC and the
    tokens. ``payload`` is any bytes-like object (a ctypes buffer: no copy is made)."""
    view = memoryview(payload).cast("B")
    packed = _token_bytes(tokens)
    header = json.dumps(
        {
            "identity": dict(identity),
            "n_tokens": len(tokens),
            "tokens_crc32": zlib.crc32(packed),
            "payload_bytes": view.nbytes,
            "payload_crc32": zlib.crc32(view),
        },
        sort_keys=True,
    ).encode()
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError(f"a state header of {len(header)} bytes is over {MAX_HEADER_BYTES}")
    return (
        _PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(header))
        + header
        + _CRC.pack(zlib.crc32(header))
        + packed
    )


def decode(data: Any, identity: Identity, tokens: Sequence[int]) -> memoryview:
    """Return the payload of the state file ``data`` (a view into it: no copy), after checking
    that it is whole and unaltered, made for ``identity`` and holds exactly ``tokens``.

    Raise StateFileError saying what is wrong.
    """
    view = memoryview(data).cast("B")
    if view.nbytes < _PREAMBLE.size:
        raise StateFileError(f"{view.nbytes} bytes: too short for a state file")
    magic, version, header_len = _PREAMBLE.unpack_from(view)
    if magic != MAGIC:
        raise StateFileError("not a phi4 state file (wrong magic)")
    if version != FORMAT_VERSION:
        raise StateFileError(f"format version {version}, not {FORMAT_VERSION}")
    if header_len > MAX_HEADER_BYTES:
        raise StateFileError(f"header length {header_len} is over {MAX_HEADER_BYTES}")
    header_end = _PREAMBLE.size + header_len
    if view.nbytes < header_end + _CRC.size:
        raise StateFileError("truncated in its header")
    header_bytes = bytes(view[_PREAMBLE.size : header_end])
    (header_crc,) = _CRC.unpack_from(view, header_end)
    if zlib.crc32(header_bytes) != header_crc:
        raise StateFileError("header checksum mismatch")
    header = _parse_header(header_bytes)
    saved_identity = header["identity"]
    for key in sorted(set(identity) | set(saved_identity)):
        if saved_identity.get(key) != identity.get(key):
            raise StateFileError(
                f"made for another {key} ({saved_identity.get(key)!r}, not {identity.get(key)!r})"
            )
    if header["n_tokens"] != len(tokens):
        raise StateFileError(f"holds {header['n_tokens']} tokens, not the {len(tokens)} expected")
    tokens_start = header_end + _CRC.size
    payload_start = tokens_start + _TOKEN_BYTES * len(tokens)
    expected_size = payload_start + header["payload_bytes"]
    if view.nbytes != expected_size:
        raise StateFileError(f"{view.nbytes} bytes where its header says {expected_size}")
    stored_tokens = view[tokens_start:payload_start]
    if zlib.crc32(stored_tokens) != header["tokens_crc32"]:
        raise StateFileError("tokens checksum mismatch")
    if stored_tokens != _token_bytes(tokens):
        raise StateFileError("holds other tokens than the conversation's")
    payload = view[payload_start:]
    if zlib.crc32(payload) != header["payload_crc32"]:
        raise StateFileError("payload checksum mismatch")
    return payload


def _parse_header(raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        raise StateFileError("header is not JSON") from None
    if not isinstance(header, dict) or not isinstance(header.get("identity"), dict):
        raise StateFileError("header has no identity")
    for key in ("n_tokens", "tokens_crc32", "payload_bytes", "payload_crc32"):
        value = header.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise StateFileError(f"header field {key} is not a count")
    return header


def private_dir(directory: Path) -> Path:
    """Create ``directory`` 0700 if missing and return it; take group and other access from one
    of ours. Raise StateFileError if it is a link, not a directory or another user's."""
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700, parents=True)
    if _check_dir(directory).st_mode & 0o077:
        os.chmod(directory, 0o700)
    return directory


def _check_dir(directory: Path) -> os.stat_result:
    """Raise StateDirError unless ``directory`` is a real directory (not a link) of ours."""
    try:
        info = directory.lstat()
    except OSError as exc:
        raise StateDirError(f"cannot use {directory}: {exc.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise StateDirError(f"{directory} is not a directory (a link?)")
    if info.st_uid != os.geteuid():
        raise StateDirError(f"{directory} belongs to uid {info.st_uid}")
    return info


def write_state(path: Path, identity: Identity, tokens: Sequence[int], payload: Any) -> int:
    """Write a state file to ``path`` atomically (a temp file, fsync, rename), mode 0600, in a
    private directory of ours; return its size. Raise OSError (a full disk) or StateFileError
    (a directory that is not ours), leaving no temp file behind."""
    head = encode_header(identity, tokens, payload)
    fd, temp = tempfile.mkstemp(
        dir=private_dir(path.parent), prefix=f".{path.name}.", suffix=".tmp"
    )
    try:
        with os.fdopen(fd, "wb") as handle:  # mkstemp: 0600, O_EXCL, no link followed
            handle.write(head)
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)  # a reader finds the old file or the new, never half of one
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    return len(head) + memoryview(payload).nbytes


def read_state(path: Path, identity: Identity, tokens: Sequence[int], max_bytes: int) -> memoryview:
    """Read the state file at ``path`` whole and return its verified payload (see
    :func:`decode`), writable, for llama.cpp to read from.

    The file must be a regular file of ours (a link, FIFO, device or directory is refused
    without being read or waited on) of at most ``max_bytes``, in a directory of ours that is
    not a link. Raise FileNotFoundError when there is none, StateDirError for a directory that
    is not ours, StateFileError for anything else.
    """
    if not os.path.lexists(path.parent):
        raise FileNotFoundError(path)
    _check_dir(path.parent)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP: a symlink
        raise StateFileError(f"cannot open it: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise StateFileError("not a regular file")
        if info.st_uid != os.geteuid():
            raise StateFileError(f"owned by uid {info.st_uid}, not us")
        if info.st_size > max_bytes:
            raise StateFileError(f"{info.st_size} bytes, over the {max_bytes} expected at most")
        data = bytearray(info.st_size)
        view = memoryview(data)
        filled = 0
        while filled < len(data):
            count = os.readv(fd, [view[filled:]])
            if count == 0:
                raise StateFileError(f"shrank to {filled} bytes while read")
            filled += count
        if os.read(fd, 1):
            raise StateFileError("grew while read")
    except OSError as exc:
        raise StateFileError(f"cannot read it: {exc.strerror}") from None
    finally:
        os.close(fd)
    return decode(data, identity, tokens)


def remove_state(path: Path) -> None:
    """Remove whatever is at ``path`` (a link itself, not its target; a directory only if
    empty); never raise."""
    with contextlib.suppress(OSError):
        if stat.S_ISDIR(path.lstat().st_mode):
            path.rmdir()
        else:
            path.unlink()
