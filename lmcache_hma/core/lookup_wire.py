"""Where the scheduler asks the worker about hits: a local ZMQ IPC socket per engine.

vLLM's CPU platform runs the scheduler and the worker in different processes, so the
scheduler cannot read the worker's CPU tier directly. Messages are JSON; the server
(``worker.lookup_server``) documents them.

The socket answers resets and holds for any request id to whoever can connect, so only
this user may: it lives in a per-user directory under the temp dir (``TMPDIR``), created
with mode 0700 and refused if another user owns it or it is open to others; the server
makes the socket itself 0600. Both processes (the same user, the same environment)
compute the same address, and both check the directory before they use it.
"""

from __future__ import annotations

import os
import tempfile
from typing import NamedTuple

from lmcache_hma.config.private_dir import OPEN_TO_OTHERS, ensure_private_dir


def socket_dir() -> str:
    """This user's directory for lookup sockets, created private (0700) or checked to be."""
    path = os.path.join(tempfile.gettempdir(), f"lmcache_hma-{os.getuid()}")
    ensure_private_dir(path, "the lookup socket's directory", OPEN_TO_OTHERS,
                       "remove it, or point TMPDIR at a directory of this user's (the connector creates "
                       "its directory there with mode 0700)", follow_symlinks=False)
    return path


def socket_address(engine_id: str) -> str:
    """The ZMQ address of the engine's lookup socket (``ipc://<socket_dir()>/<engine id>.sock``)."""
    safe = "".join(c for c in engine_id if c.isalnum() or c in "-_")[:64]
    return f"ipc://{os.path.join(socket_dir(), f'{safe}.sock')}"


def socket_path(address: str) -> str:
    """The file of an ``ipc://`` address."""
    return address[len("ipc://"):]


class Found(NamedTuple):
    """A lookup's answer (``LookupAnswers._answer_lookup``)."""

    chunks: int  # whole chunks of the hit
    held: bool  # their objects are held for the lookup
    tiers: tuple[str, ...]  # per chunk (and the turn end's object, if any), the tier it is in
    marks: tuple[int, ...] = ()  # a marker's offsets: nothing held, ask again with candidates
    mark_chunk: int = 0  # the chunk the marker's turn ends are in
    turn_end: int = 0  # the hit ends at this turn end
    turn_on_tail: bool = False  # ... stored ``on_tail`` (ObjectRef.on_tail)
    run: int = 0  # whole chunks with a full object from the first (>= chunks: past it no tail is stored)
