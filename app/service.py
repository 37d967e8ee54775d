"""Running a sidecar: as a service (its own process, until SIGTERM/SIGINT) or hosted inside an
engine's worker process (``InProcessAgent``), with the same control port, engine socket and
admin API either way."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from app.config import SidecarSettings
from app.errors import DeadlineExceeded, KVSidecarError
from app.ports import clear_port_file, write_port_file
from app.transfer.lanes.mooncake import MooncakeEngine
from app.transfer.sidecar.process import Sidecar

log = logging.getLogger(__name__)


async def run_until(
    settings: SidecarSettings,
    stop: asyncio.Event,
    ready: Callable[[], None] | None = None,
    *,
    engine_hook: Callable[[MooncakeEngine], None] | None = None,
) -> dict[str, Any]:
    """Start the sidecar and its admin API, call ``ready``, serve until ``stop`` is set, then
    shut down (in-flight requests get the grace period, then are aborted); the shutdown report.
    ``engine_hook`` (tests only) goes to the ``Sidecar``."""
    for note in settings.warnings():
        log.warning(note)
    if settings.port_file is not None:
        clear_port_file(settings.port_file)  # an earlier run's ports are not ours
    sidecar = Sidecar(settings, engine_hook=engine_hook)
    await sidecar.start()
    admin = None
    try:
        from app.api.server import AdminServer  # the admin API, when present

        admin = AdminServer(sidecar, settings)
        await admin.start()
    except ImportError:
        pass
    ports = {"control_port": sidecar.control_port}
    if admin is not None:
        ports["admin_port"] = admin.port
    log.info("listening: %s", " ".join(f"{k}={v}" for k, v in ports.items()))
    if settings.port_file is not None:
        write_port_file(settings.port_file, ports)
    if ready is not None:
        ready()
    await stop.wait()
    log.info("stopping: no longer admitting, grace %.1fs", settings.shutdown_grace_s)
    report = await sidecar.stop()
    if admin is not None:
        await admin.stop()
    if settings.port_file is not None:
        clear_port_file(settings.port_file)  # nothing listens on those ports any more
    return report


async def serve(
    settings: SidecarSettings, *, engine_hook: Callable[[MooncakeEngine], None] | None = None
) -> int:
    """Run until a stop signal; ``engine_hook`` (tests only) goes to the ``Sidecar``."""
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    report = await run_until(settings, stop, engine_hook=engine_hook)
    print(json.dumps({"shutdown": report}), file=sys.stderr, flush=True)
    return 0


class InProcessAgent:
    """The agent hosted inside the engine's own process (DESIGN §7), for deployments that cannot
    share device memory across containers: the whole sidecar on a thread of its own with its
    own event loop. The engine reaches it through ``settings.engine_ipc`` exactly as it would a
    separate container, so the connector changes in nothing but who starts it. The engine
    process keeps its signals and its logging."""

    def __init__(self, settings: SidecarSettings) -> None:
        self.settings = settings
        self.report: dict[str, Any] | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="kv-sidecar-agent", daemon=True)

    def start(self, timeout_s: float = 60.0) -> str:
        """Start serving; returns the engine socket's endpoint once it accepts calls."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise DeadlineExceeded(f"the in-process agent did not start within {timeout_s}s")
        if self._error is not None:
            raise KVSidecarError(f"the in-process agent failed to start: {self._error}") from (
                self._error
            )
        return self.settings.engine_ipc

    def stop(self, timeout_s: float = 30.0) -> None:
        """Shut down as a separate sidecar would on SIGTERM, and wait for the thread."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # reported by start(); the engine decides what to do
            self._error = e
            log.exception("in-process agent stopped")
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.report = await run_until(self.settings, self._stop, ready=self._ready.set)
