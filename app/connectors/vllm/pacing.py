"""How often a worker asks its sidecar what finished while the engine runs no forward pass.

While decode's engine holds only requests waiting for their KV, vLLM's engine core loops
without a forward pass and calls the connector's ``get_finished`` on every turn of that loop.
Each call is a round trip to the sidecar: measured on a 2-core host, 330 a second while one
6000-token prompt computed on prefill, ~2,500 for that request, the CPU the sidecars spent
beyond MooncakeConnector's transfer threads (whose ``get_finished`` reads local state). The
pacer spaces those calls ``interval_s`` apart, the worker sleeping out the rest: a load that
landed is seen at most ``interval_s`` later, and the steps that run a forward pass never wait.
Where the sidecar mapped the rank's finished bell (``app.devices.bell``) a step, paced or with a
forward pass, asks only when the bell moved, or once a second.

Under data parallel an idle rank's no-forward step runs in lockstep with the other ranks'
forward passes (vLLM's ``coordinate_batch_across_dp``): sleeping there would stretch their
steps to ``interval_s``. Such a rank skips the round trip instead (``wait=False``): the sidecar
is still asked at most once per ``interval_s``, and no step takes longer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_IDLE_POLL_S = 0.01


@dataclass
class IdlePollPacer:
    """Spaces the round trips of no-forward steps; ``interval_s`` 0 turns it off. ``wait``:
    sleep until the next is due (one engine), or skip it (a data-parallel rank)."""

    interval_s: float = DEFAULT_IDLE_POLL_S
    wait: bool = True
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    last: float | None = field(default=None, init=False)

    def due(self, forward: bool) -> bool:
        """Whether this step asks the sidecar now. A step that ran a forward pass does at once;
        a no-forward step once ``interval_s`` passed since the previous round trip (of any
        step), after sleeping until then where it ``wait``s."""
        now = self.clock()
        if not forward and self.last is not None:
            left = self.last + self.interval_s - now
            if left > 0:
                if not self.wait:
                    return False
                self.sleep(left)
                now = self.clock()
        self.last = now
        return True
