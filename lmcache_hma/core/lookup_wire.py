"""Where the scheduler asks the worker about hits: a local ZMQ IPC socket per engine.

vLLM's CPU platform runs the scheduler and the worker in different processes, so the
scheduler cannot read the worker's CPU tier directly. Messages are JSON; the server
(``worker.lookup_server``) documents them.
"""

from __future__ import annotations

import os
import tempfile


def socket_address(engine_id: str) -> str:
    safe = "".join(c for c in engine_id if c.isalnum() or c in "-_")[:64]
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'lmcache_hma-{safe}.sock')}"
