"""The app on uvicorn, as `churon serve` runs it: churon's connection guards, the file limit raised, and
the graceful shutdown of drain.py on the first SIGTERM or SIGINT.

uvicorn's own shutdown stops accepting, waits for the open responses (up to timeout_graceful_shutdown)
and then cancels them, cutting a stream mid-way. Here the first signal starts the app's Drain: its
grace period ends every request still running with its final event, and uvicorn's own timeout, a few
seconds later, is only the backstop. A second signal ends them at once; a third is uvicorn's forced exit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import resource
from types import FrameType

import uvicorn
from fastapi import FastAPI

from churon.server.connections import ConnectionLimits, GuardedHTTPProtocol
from churon.server.drain import Drain

log = logging.getLogger("churon.server")

DEFAULT_SHUTDOWN_TIMEOUT = 30.0
# file descriptors kept for all but the connections: the listening socket, model files, logs, the
# event loop's and the thread pools' own
RESERVED_FILES = 128
_BACKSTOP_SECONDS = 5  # past the grace period, for the streams to send their last events


def raise_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one where allowed; the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:  # a platform cap below the hard limit (macOS): keep what is
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
    return soft


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Drain, shutdown_timeout: float):
        super().__init__(config)
        self.drain = drain
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0

    async def shutdown(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        self.drain.begin(0 if self._signals > 1 else self.shutdown_timeout)
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._signals += 1
        if self._signals == 2:  # the grace period cut short: end the running requests, properly, now
            self._captured_signals.append(sig)
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self.drain.expire)
            return
        super().handle_exit(sig, frame)


def make_server(app: FastAPI, host: str, port: int, *, log_level: str = "info",
                shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
                connection_limits: ConnectionLimits = ConnectionLimits()) -> DrainingServer:
    """app: create_app's. connection_limits.max_connections None: the file limit less RESERVED_FILES."""
    if not shutdown_timeout >= 0:
        raise ValueError(f"shutdown_timeout={shutdown_timeout!r}: must be >= 0 seconds")
    files = raise_file_limit()
    if connection_limits.max_connections is None:
        connection_limits = dataclasses.replace(connection_limits, max_connections=max(1, files - RESERVED_FILES))
    elif connection_limits.max_connections > files - RESERVED_FILES:
        log.warning("--max-connections %d leaves fewer than %d of the open-file limit of %d for the rest: the server"
                    " may run out of files", connection_limits.max_connections, RESERVED_FILES, files)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            http=functools.partial(GuardedHTTPProtocol, limits=connection_limits),
                            timeout_graceful_shutdown=math.ceil(shutdown_timeout) + _BACKSTOP_SECONDS)
    return DrainingServer(config, app.state.server.drain, shutdown_timeout)
