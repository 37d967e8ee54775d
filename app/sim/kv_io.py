"""Writing the fill into a rank's KV cache through its views, and the decode-side oracle.

The oracle derives what D must hold from attention semantics (a sliding-window layer needs the
last ``window - 1`` prompt tokens, a state layer the state after ``prompt_len - 1`` tokens), the
D rank's own views and the fill function: it never looks at a plan.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from app.kvcache.groups import NULL_BLOCK
from app.kvcache.layout import RankLayout, allocate
from app.kvcache.specs import AttentionSpec, MambaSpec, SpecKind
from app.sim.fill import LATENT, K, V, as_int, sentinel_bytes, state_values, token_values


def _token_index(
    layout: RankLayout, layer: int, ids: np.ndarray, tokens: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = layout.group(layout.placements[layer].group)
    kb, r = g.kernel_block_size, g.ratio
    j = tokens // kb
    return (torch.from_numpy(ids[j // r]), torch.from_numpy(j % r), torch.from_numpy(tokens % kb))


def _token_streams(layout: RankLayout, layer: int) -> list[tuple[str, int]]:
    spec = layout.spec(layer)
    return [("k", K), ("v", V)] if isinstance(spec, AttentionSpec) else [("latent", LATENT)]


def write_tokens(
    layout: RankLayout, layer: int, ids: np.ndarray, start: int, end: int, salt: int = 0
) -> None:
    """What the forward pass writes for tokens ``[start, end)`` of a request into ``ids``."""
    spec = layout.spec(layer)
    assert not isinstance(spec, MambaSpec)
    tokens = np.arange(start, end)
    mid, sub, off = _token_index(layout, layer, ids, tokens)
    for name, stream in _token_streams(layout, layer):
        view = as_int(layout.views[layer][name])
        vals = token_values(spec, layer, stream, tokens, layout.tp, layout.rank, salt)
        if layout.kv_layout.value == "HND" and name != "latent":
            view[mid, sub, :, off, :] = vals
        else:
            view[mid, sub, off] = vals


def write_state(layout: RankLayout, layer: int, block: int, n_tokens: int, salt: int = 0) -> None:
    spec = layout.spec(layer)
    assert isinstance(spec, MambaSpec)
    for name, vals in state_values(spec, layer, n_tokens, layout.tp, layout.rank, salt).items():
        as_int(layout.views[layer][name])[block] = vals


def check_tokens(
    layout: RankLayout, layer: int, ids: np.ndarray, tokens: np.ndarray, salt: int = 0
) -> int:
    """Number of wrong elements among ``tokens`` of one layer."""
    spec = layout.spec(layer)
    assert not isinstance(spec, MambaSpec)
    if tokens.size == 0:
        return 0
    bad = 0
    for name, stream in _token_streams(layout, layer):
        got = _token_rows(layout, layer, name, ids, tokens)
        want = token_values(spec, layer, stream, tokens, layout.tp, layout.rank, salt)
        bad += int((got != want).sum())
    return bad


def _token_rows(
    layout: RankLayout, layer: int, name: str, ids: np.ndarray, tokens: np.ndarray
) -> torch.Tensor:
    mid, sub, off = _token_index(layout, layer, ids, tokens)
    view = as_int(layout.views[layer][name])
    if layout.kv_layout.value == "HND" and name != "latent":
        return view[mid, sub, :, off, :]
    return view[mid, sub, off]


def outside_read_set(
    layout: RankLayout,
    blocks: Sequence[np.ndarray],
    prompt_len: int,
    mamba_mode: str = "none",
    num_spec: int = 0,
) -> list[str]:
    """A request's blocks hold nothing beyond what D reads (they started all zero): no token
    past the prompt in its last block, no block wholly before a sliding window, no state
    block but the final one. One line per layer that has something there."""
    problems = []
    for g in layout.config.groups:
        ids = blocks[g.index]
        for c in g.layers:
            if g.kind is SpecKind.MAMBA:
                final = state_block_index(ids.size, mamba_mode, num_spec)
                others = [int(b) for i, b in enumerate(ids) if i != final]
                written = sum(
                    int(as_int(view)[others].count_nonzero())
                    for view in layout.views[c.index].values()
                )
            else:
                tokens = np.arange(prompt_len, ids.size * g.block_size)
                if g.kind is SpecKind.SLIDING and g.sliding_window:
                    # The last prompt token, which decode computes, reads from here on.
                    first = max(0, prompt_len - g.sliding_window) // g.block_size
                    tokens = np.concatenate([np.arange(first * g.block_size), tokens])
                written = sum(
                    int(_token_rows(layout, c.index, name, ids, tokens).count_nonzero())
                    for name, _ in _token_streams(layout, c.index)
                    if tokens.size
                )
            if written:
                problems.append(
                    f"rank {layout.rank} layer {c.index} ({c.name}): {written} elements written "
                    "outside what decode reads"
                )
    return problems


def check_state(layout: RankLayout, layer: int, block: int, n_tokens: int, salt: int = 0) -> int:
    spec = layout.spec(layer)
    assert isinstance(spec, MambaSpec)
    bad = 0
    for name, want in state_values(spec, layer, n_tokens, layout.tp, layout.rank, salt).items():
        bad += int((as_int(layout.views[layer][name])[block] != want).sum())
    return bad


def state_block_index(n_ids: int, mamba_mode: str, num_spec: int) -> int:
    """Which of a request's state block ids holds the final state (vLLM's none/align rule)."""
    return 0 if mamba_mode == "none" else n_ids - 1 - num_spec


def verify_request(
    layout: RankLayout,
    blocks: Sequence[np.ndarray],
    prompt_len: int,
    mamba_mode: str = "none",
    num_spec: int = 0,
    salt: int = 0,
) -> list[str]:
    """Everything D reads for this request, compared with the fill; one line per bad layer."""
    problems = []
    for g in layout.config.groups:
        ids = blocks[g.index]
        for c in g.layers:
            if g.kind is SpecKind.MAMBA:
                block = int(ids[state_block_index(ids.size, mamba_mode, num_spec)])
                # The P side sends the state of prompt_len - 1 tokens; D recomputes the last.
                bad = check_state(layout, c.index, block, prompt_len - 1, salt)
            else:
                # Decode computes the last prompt token, attending to the tokens before it:
                # within a sliding window, the window - 1 of them from prompt_len - window on.
                lo = 0
                if g.kind is SpecKind.SLIDING and g.sliding_window:
                    lo = max(0, prompt_len - g.sliding_window)
                bad = check_tokens(layout, c.index, ids, np.arange(lo, prompt_len - 1), salt)
            if bad:
                problems.append(f"rank {layout.rank} layer {c.index} ({c.name}): {bad} wrong")
    return problems


def untouched(layout: RankLayout, used: set[int]) -> list[str]:
    """Blocks no request owns (the null block included) must still be all zero."""
    free = np.array(sorted(set(range(layout.num_blocks)) - used | {NULL_BLOCK}), np.int64)
    out = []
    for i, buf in enumerate(layout.buffers):
        rows = buf.view(layout.num_blocks, -1)[torch.from_numpy(free)]
        if bool(rows.any()):
            out.append(f"rank {layout.rank} buffer {i}: bytes written outside the request blocks")
    return out


def verify_prefix(layout: RankLayout, blocks: Sequence[np.ndarray], hit_tokens: int) -> list[str]:
    """What a pool hit of ``hit_tokens`` must have put in place, compared with the fill:
    attention tokens below the hit (a sliding window only its last ``window - 1``), and the
    Mamba-style state after exactly ``hit_tokens`` tokens (align mode: block ``hit/bs - 1``)."""
    problems = []
    for g in layout.config.groups:
        ids = blocks[g.index]
        for c in g.layers:
            if g.kind is SpecKind.MAMBA:
                if hit_tokens == 0:
                    continue
                bad = check_state(
                    layout, c.index, int(ids[hit_tokens // g.block_size - 1]), hit_tokens
                )
            else:
                lo = 0
                if g.kind is SpecKind.SLIDING and g.sliding_window:
                    lo = max(0, hit_tokens - (g.sliding_window - 1))
                bad = check_tokens(layout, c.index, ids, np.arange(lo, hit_tokens))
            if bad:
                problems.append(f"rank {layout.rank} layer {c.index} ({c.name}): {bad} wrong")
    return problems


# ---- whole-cache sentinel ------------------------------------------------------------------
#
# ``outside_read_set`` and ``untouched`` look at what the views of a request show and at free
# blocks; bytes no view covers (a state page's padding up to the unified page, the gap between
# slots) and a write shifted into another request's blocks can slip past them. The sentinel
# check covers every byte of every buffer: fill it all with a known pattern before the
# transfer, mark what the requests may have written, and count the bytes that changed anyway.


def sentinel_fill(layout: RankLayout, seed: int) -> None:
    """Every byte of every buffer of this rank set to the sentinel pattern."""
    for i, buf in enumerate(layout.buffers):
        buf.copy_(sentinel_bytes(buf.numel(), i, seed))


def blank_like(layout: RankLayout) -> RankLayout:
    """The same geometry (buffers, views) over private zeroed memory: a byte mask."""
    return allocate(
        layout.config,
        layout.rank,
        mode=layout.mode,
        kv_layout=layout.kv_layout,
        heads_major=layout.heads_major,
        stacked=layout.stacked,
    )


def mark_read_set(
    mask: RankLayout,
    blocks: Sequence[np.ndarray],
    prompt_len: int,
    mamba_mode: str = "none",
    num_spec: int = 0,
) -> None:
    """Set every byte a request's transfer may write: the complement of ``outside_read_set``
    within its blocks (prompt tokens, from the first window block for a sliding window; the
    final state block)."""
    for g in mask.config.groups:
        ids = blocks[g.index]
        for c in g.layers:
            if g.kind is SpecKind.MAMBA:
                final = int(ids[state_block_index(ids.size, mamba_mode, num_spec)])
                for view in mask.views[c.index].values():
                    as_int(view)[final] = -1
                continue
            lo = 0
            if g.kind is SpecKind.SLIDING and g.sliding_window:
                lo = max(0, prompt_len - g.sliding_window) // g.block_size * g.block_size
            # Whole kernel blocks go, so the last token's row may come along with the one
            # before it; decode holds no block for it when it starts a block.
            tokens = np.arange(lo, min(prompt_len, ids.size * g.block_size))
            if not tokens.size:
                continue
            mid, sub, off = _token_index(mask, c.index, ids, tokens)
            for name, _ in _token_streams(mask, c.index):
                view = as_int(mask.views[c.index][name])
                if mask.kv_layout.value == "HND" and name != "latent":
                    view[mid, sub, :, off, :] = -1
                else:
                    view[mid, sub, off] = -1


def mark_blocks(mask: RankLayout, blocks: Sequence[np.ndarray]) -> None:
    """Set everything the views show of a request's blocks (the null block excepted): what a
    request that did not end DONE may have left there."""
    for g in mask.config.groups:
        ids = blocks[g.index]
        owned = torch.from_numpy(ids[ids != NULL_BLOCK])
        for c in g.layers:
            for view in mask.views[c.index].values():
                as_int(view)[owned] = -1


def changed_outside(
    layout: RankLayout,
    seed: int,
    requests: Sequence[tuple[Sequence[np.ndarray], int, bool]],
    mamba_mode: str = "none",
    num_spec: int = 0,
) -> tuple[int, list[str]]:
    """Bytes of a sentinel-filled rank that changed outside what ``requests`` may write.

    ``requests``: (block ids per group, prompt length, ended DONE). A DONE request may have
    written its read set only; any other its blocks. Returns the number of changed bytes and
    one line per buffer that has some.
    """
    mask = blank_like(layout)
    for blocks, prompt_len, done in requests:
        if done:
            mark_read_set(mask, blocks, prompt_len, mamba_mode, num_spec)
        else:
            mark_blocks(mask, blocks)
    total, problems = 0, []
    for i, (buf, allowed) in enumerate(zip(layout.buffers, mask.buffers, strict=True)):
        changed = (buf != sentinel_bytes(buf.numel(), i, seed)) & (allowed == 0)
        n = int(changed.sum())
        if n:
            first = int(changed.nonzero()[0, 0])
            page = buf.numel() // layout.num_blocks
            total += n
            problems.append(
                f"rank {layout.rank} buffer {i}: {n} bytes changed outside the read sets "
                f"(the first at byte {first}, block {first // page} if the buffer is "
                "block-major)"
            )
    return total, problems


def _blocks_mask(layout: RankLayout, requests: Sequence[Sequence[np.ndarray]]) -> RankLayout:
    mask = blank_like(layout)
    for blocks in requests:
        mark_blocks(mask, blocks)
    return mask


def restore_sentinel(
    layout: RankLayout, seed: int, requests: Sequence[Sequence[np.ndarray]]
) -> None:
    """Put the sentinel back into these requests' blocks: what an engine that frees them and
    hands them to the next request would leave for ``changed_in_blocks`` to look at."""
    if not requests:
        return
    mask = _blocks_mask(layout, requests)
    for i, (buf, m) in enumerate(zip(layout.buffers, mask.buffers, strict=True)):
        sel = m != 0
        buf[sel] = sentinel_bytes(buf.numel(), i, seed)[sel]


def changed_in_blocks(
    layout: RankLayout, seed: int, requests: Sequence[Sequence[np.ndarray]]
) -> int:
    """Bytes of these requests' blocks that differ from the sentinel (after
    ``restore_sentinel``: written after the engine had released them)."""
    if not requests:
        return 0
    mask = _blocks_mask(layout, requests)
    return sum(
        int(((buf != sentinel_bytes(buf.numel(), i, seed)) & (m != 0)).sum())
        for i, (buf, m) in enumerate(zip(layout.buffers, mask.buffers, strict=True))
    )
