"""The engine link's KV pool calls (lookup, save, load, poll), answered from the sidecar's pool.

A save or load past the pool's timeout is answered ``pending`` (``store.running``); the engine
keeps its blocks and polls until the store call returned."""

from __future__ import annotations

from app.store.service import PoolService
from app.transfer.requests.agent import blocks
from app.transfer.wire.protocol import (
    Msg,
    PoolLoad,
    PoolLoaded,
    PoolLookup,
    PoolPoll,
    PoolRunning,
    PoolSave,
    Reply,
)


async def pool_call(
    pool: PoolService | None, msg: PoolLookup | PoolSave | PoolLoad | PoolPoll
) -> Msg:
    """An engine's KV pool call, answered from this sidecar's pool (None: not enabled)."""
    if pool is None:
        return Reply(
            ok=False,
            error="the KV pool is not enabled on this sidecar; set "
            "KVSIDECAR_POOL__ENABLED=true and the master address",
        )
    if isinstance(msg, PoolPoll):
        return PoolRunning(
            loads=pool.running.running(msg.rank, "load", msg.loads),
            saves=pool.running.running(msg.rank, "save", msg.saves),
        )
    if isinstance(msg, PoolLookup):
        hit = await pool.lookup(msg.rank, msg.token_ids, msg.extra_keys)
        return Reply(data={"hit_tokens": hit.hit_tokens})
    if isinstance(msg, PoolSave):
        saved = await pool.save(
            msg.rank,
            msg.token_ids,
            blocks(msg.block_ids),
            msg.num_computed,
            msg.extra_keys,
            request=msg.request,
            stored_tokens=msg.stored_tokens,
        )
        return Reply(
            data={
                "stored": saved.stored,
                "skipped": saved.skipped,
                "backpressure": saved.backpressure,
                "failed": saved.failed,
                "bytes": saved.bytes,
                "pending": saved.pending,
            }
        )
    loaded = await pool.load(
        msg.rank,
        msg.token_ids,
        blocks(msg.block_ids),
        msg.hit_tokens,
        msg.extra_keys,
        held_tokens=msg.held_tokens,
        request=msg.request,
    )
    return PoolLoaded(
        loaded=loaded.loaded,
        bytes=loaded.bytes,
        failed_blocks=loaded.failed_blocks,
        pending=loaded.pending,
    )
