"""Calls to a Redis tier's servers within one deadline, for ``RedisTier`` and its subclasses.

A call sends packed commands (``wire``) on a connection of a redis-py client's pool and
reads their replies with ``resp.BulkReader``, the handshake of a new connection included,
all against one ``resp.Deadline``: ``hma_remote_timeout_s`` plus the time its objects'
bytes take at ``MIN_BYTES_PER_S``. A pooled connection found broken (a restarted Redis)
is replaced once; any failure drops the connection; a reply that breaks RESP or its
length limits is counted in ``protocol_errors``. Kept apart from the tiers, which decide
what to send and to which server, while this is how every call is made.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from lmcache_hma.log import get_logger
from lmcache_hma.store.redis import resp
from lmcache_hma.store.redis.wire import (SMALL_BUFFER, broken_connection, command, connection, give_back,
                                          protocol_error)

logger = get_logger(__name__)


class DeadlineCalls:
    """Mixed into a Redis tier, which gives ``_timeout_s`` (``hma_remote_timeout_s``),
    ``_counts_lock``, ``protocol_errors``, ``WHAT`` and ``url``."""

    # A call's deadline: hma_remote_timeout_s, plus its objects' bytes at this rate (the slowest
    # a Redis that is not in trouble may be; a 64 MiB write batch gets 1 s more).
    MIN_BYTES_PER_S = 64 << 20

    def _ping(self, client) -> tuple[bool, str]:
        """(whether ``client``'s Redis answers PING within the deadline, why not)."""
        try:
            reply = self._call(client, [command(b"PING")], lambda reader: reader.status())
        except resp.ReplyError as exc:  # named as redis-py names it
            auth = str(exc).startswith(("NOAUTH", "WRONGPASS"))
            return False, f"{'AuthenticationError' if auth else 'ResponseError'}: {exc}"
        except Exception as exc:
            return False, f"{type(exc).__name__}: {exc}"
        return (True, "") if reply == b"PONG" else (False, f"PING answered {reply[:40]!r}")

    def _deadline(self, nbytes: int = 0, by: Optional[float] = None) -> resp.Deadline:
        """The deadline of one call that moves ``nbytes`` of objects; no later than ``by``
        (``time.monotonic()``, the caller's own deadline) when given."""
        seconds = self._timeout_s + nbytes / self.MIN_BYTES_PER_S
        return resp.Deadline(seconds if by is None else min(seconds, by - time.monotonic()))

    def _call(self, client, pieces: list, read: Callable, deadline: Optional[resp.Deadline] = None):
        """Send ``pieces`` (packed commands) on a connection of ``client``'s pool and return
        ``read(reader)`` (its replies), all within ``deadline``. A pooled connection found
        broken (a restarted Redis) is replaced once; any failure drops the connection."""
        deadline = deadline or self._deadline()
        for attempt in (0, 1):
            conn = None
            try:
                conn = connection(client, deadline)
                sock = resp.socket_of(conn)
                resp.send(sock, pieces, deadline)
                reader = resp.BulkReader(sock, deadline, SMALL_BUFFER)
                out = read(reader)
            except BaseException as exc:
                give_back(client, conn, broken=True)
                self._count(exc)
                if attempt or not broken_connection(exc):
                    raise
                continue
            give_back(client, conn, broken=not reader.drained)
            return out

    def _count(self, exc: BaseException) -> None:
        """Count (and log, now and then) a reply that broke RESP or its length limits."""
        if not protocol_error(exc):
            return
        with self._counts_lock:
            self.protocol_errors += 1
            n = self.protocol_errors
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th, ...
            logger.warning("LMCacheHMA: the %s %s sent a reply that is not what was asked for (%s); its "
                           "connection was dropped and the call's objects are misses (%d such replies so far)",
                           self.WHAT, self.url, exc, n)
