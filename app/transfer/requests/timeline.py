"""Per-layer timeline of a send, and per-step signal counts of a rank.

For each step and layer of a send: when the engine signalled it (during the forward pass, or
only at the step's end), when its write was submitted, when it landed, how many bytes. For each
step of a rank: when it was announced, when its forward pass ended, how many layers the engine
signalled during the forward pass and how many only at its end. The second pair is how a
degraded push shows itself: an engine hook that announces a step too late signals every
layer at the step's end, and the push becomes a bulk write after the forward pass.

Times are ``time.monotonic()`` here; the admin API turns them into wall-clock seconds.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

# A send keeps at most this many (step, layer) entries: a 128k-token prompt in 512-token
# chunks over 64 layers is 16384; past the cap the first entries are kept, not the last.
MAX_LAYER_ENTRIES = 16384
# A rank keeps its last steps' records for the admin API and the requests that ran in them.
MAX_STEPS = 256


@dataclass
class StepRecord:
    """One forward step of a rank, as the engine announced and ended it."""

    step: int
    began: float = field(default_factory=time.monotonic)
    forward_ended: float | None = None
    in_forward: int = 0  # layers signalled during the forward pass
    at_step_end: int = 0  # layers signalled only after it (wait_for_save)


@dataclass
class LayerTimes:
    """One layer of one step of a send."""

    step: int
    layer: int
    signalled: float
    at_step_end: bool
    group: int | None = None
    submitted: float | None = None
    landed: float | None = None
    bytes: int = 0


class SendTimeline:
    """A send's layers and the steps it was in."""

    def __init__(self) -> None:
        self.layers: dict[tuple[int, int], LayerTimes] = {}
        self.steps: dict[int, StepRecord] = {}

    def signalled(self, step: int, layer: int, at_step_end: bool, now: float) -> None:
        key = (step, layer)
        if key not in self.layers and len(self.layers) < MAX_LAYER_ENTRIES:
            self.layers[key] = LayerTimes(step, layer, now, at_step_end)

    def written(
        self, step: int, layer: int, group: int, submitted: float, landed: float, nbytes: int
    ) -> None:
        t = self.layers.get((step, layer))
        if t is None:
            return
        # A layer can be written in several submissions (a backlog, a peer at a time).
        t.group = group
        t.submitted = submitted if t.submitted is None else min(t.submitted, submitted)
        t.landed = landed if t.landed is None else max(t.landed, landed)
        t.bytes += nbytes


class StepLog:
    """A rank's recent steps and its signal totals."""

    def __init__(self) -> None:
        self.steps: OrderedDict[int, StepRecord] = OrderedDict()
        self.in_forward = 0
        self.at_step_end = 0

    def begin(self, step: int) -> StepRecord:
        rec = self.steps.get(step)
        if rec is None:
            rec = self.steps[step] = StepRecord(step)
            while len(self.steps) > MAX_STEPS:
                self.steps.popitem(last=False)
        return rec

    def signalled(self, step: int, at_step_end: bool) -> None:
        rec = self.steps.get(step)
        if at_step_end:
            self.at_step_end += 1
        else:
            self.in_forward += 1
        if rec is not None:
            if at_step_end:
                rec.at_step_end += 1
            else:
                rec.in_forward += 1

    def forward_ended(self, step: int, now: float) -> None:
        rec = self.steps.get(step)
        if rec is not None and rec.forward_ended is None:
            rec.forward_ended = now

    def last(self) -> StepRecord | None:
        return next(reversed(self.steps.values()), None)
