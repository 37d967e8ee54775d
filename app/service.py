"""Running a sidecar as a service: start, serve until SIGTERM/SIGINT, shut down gracefully."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys

from app.config import SidecarSettings
from app.transfer.sidecar import Sidecar

log = logging.getLogger(__name__)


async def serve(settings: SidecarSettings) -> int:
    """Run until a stop signal; in-flight requests get the grace period, then are aborted."""
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for note in settings.warnings():
        log.warning(note)
    sidecar = Sidecar(settings)
    await sidecar.start()
    admin = None
    try:
        from app.api.server import AdminServer  # the admin API, when present

        admin = AdminServer(sidecar, settings)
        await admin.start()
    except ImportError:
        pass
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stop signal: no longer admitting, grace %.1fs", settings.shutdown_grace_s)
    report = await sidecar.stop()
    if admin is not None:
        await admin.stop()
    print(json.dumps({"shutdown": report}), file=sys.stderr, flush=True)
    return 0
