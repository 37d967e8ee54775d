"""Bounds a layout value must meet to decode at all (DESIGN §4).

The layout structs (``desc``, ``layout``) travel in ``AgentMetadata`` as they are, so their
fields carry these constraints: a peer that sends a rank of -1 or a TP size of 0 gets a
ProtocolError naming the field instead of a ZeroDivisionError deep in the planner. msgspec
checks them on decode only; values built in-process are trusted.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

MAX_TP = 1024  # the settings' tp_size bound

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
"""Counts, offsets, strides, byte sizes, token positions, steps."""
Index = Annotated[int, msgspec.Meta(ge=0)]
"""Ranks, layers, groups, block ids, token ids."""
Positive = Annotated[int, msgspec.Meta(ge=1)]
TpSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_TP)]
