"""Mid-stream migration's calls (migration.py is the pure part): the relay of a streamed
answer, which goes on from another decode when the one serving it breaks off after the
client's first byte (docs/serving.md, "A decode that dies mid-stream").

Each decode that serves part of the stream is a transfer of its own: the one that broke off
ends ``broken`` with ``retried_as`` naming the next, whose record says ``migrated_at_token``
(the tokens the client had) and ``migrated_from`` (the decode that broke off), and carries a
``mid_stream`` retry. The continuation takes the normal P/D path with the longer prompt: a
prefill (whose prefix cache or the pool holds the prompt) computes it, or decode alone when
the rules say so.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import anyio
import httpx
from fastapi.responses import Response

from app.proxy.balancer import is_connection_failure
from app.proxy.exchange import Exchange, describe
from app.proxy.migration import COMPLETIONS_PATH, BrokenStream, Outcome, Stitch
from app.proxy.records import DecodeOutcome
from app.proxy.retries import Retry

if TYPE_CHECKING:
    from app.proxy.flow import PDFlow

log = logging.getLogger(__name__)

Segment = tuple[Exchange, AsyncIterator[bytes]]


def _is_sse(x: Exchange) -> bool:
    ctype = "" if x.upstream is None else x.upstream.headers.get("content-type", "")
    return ctype.startswith("text/event-stream")


async def relay(
    flow: PDFlow,
    x: Exchange,
    first: bytes,
    chunks: AsyncIterator[bytes],
    stitch: Stitch | None,
    headers: dict[str, str],
) -> AsyncIterator[bytes]:
    """The client's stream: decode's events, and a continuation's after each migration."""
    # Only an event stream that answered 200 is read; anything else is relayed as it comes.
    ok = x.tracker.decode_status == 200 and _is_sse(x)
    s = stitch if ok and stitch is not None and stitch.refused is None else None
    while True:
        outcome: DecodeOutcome = "client_gone"  # unless the loop below ends on its own
        error: str | None = None
        following: Segment | None = None
        try:
            async for out in _segment(first, chunks, s):
                yield out
            outcome, error = flow._verdict(x)
            if s is not None and not s.done:
                raise BrokenStream(s.failure or "its stream ended before [DONE]")
        except (httpx.HTTPError, BrokenStream) as e:
            outcome = "broken"
            error = f"decode instance {x.decode.url} broke off its answer: {describe(e)}"
            log.error("transfer %s: %s", x.tracker.transfer_id, error)
            if isinstance(e, httpx.HTTPError) and is_connection_failure(e):
                x.decode.instance.mark(False, f"connection failed: {describe(e)}")
            tail = b""
            if stitch is not None:
                got = await _migrate(flow, x, s, stitch, error, headers)
                tail, following = (got, None) if isinstance(got, bytes) else (b"", got)
            if tail:
                yield tail  # the client had every token: only the stream's end was missing
            elif following is None and (s is not None or _is_sse(x)):
                # Headers are out; an error event is how vLLM itself reports this mid-stream.
                event = {"error": {"message": error, "type": "bad_gateway", "code": 502}}
                yield f"data: {json.dumps(event)}\n\n".encode()
        finally:
            # Shielded: on a disconnect this runs inside a cancelled scope.
            with anyio.CancelScope(shield=True):
                await x.end(outcome, error)
        if following is None:
            return
        (x, chunks), first, s = following, b"", stitch


async def _segment(
    first: bytes, chunks: AsyncIterator[bytes], s: Stitch | None
) -> AsyncIterator[bytes]:
    """One decode's part of the stream: as it comes, or through ``s`` (whole events, counted,
    rewritten; an error event ends it)."""
    if s is None:
        if first:
            yield first
        async for chunk in chunks:
            yield chunk
        return
    for out in s.feed(first):
        yield out
    async for chunk in chunks:
        for out in s.feed(chunk):
            yield out
        if s.failure is not None:
            raise BrokenStream(f"an error event: {s.failure}")
    if s.failure is not None:
        raise BrokenStream(f"an error event: {s.failure}")


async def _migrate(
    flow: PDFlow,
    x: Exchange,
    s: Stitch | None,
    stitch: Stitch,
    error: str,
    headers: dict[str, str],
) -> Segment | bytes | None:
    """The next segment of the stream (a new transfer on a decode), the stream's missing end
    (bytes), or None: the stream ends with an error event."""
    t = x.tracker

    def give_up(outcome: Outcome, why: str) -> None:
        flow.metrics.migration(outcome)
        log.warning("transfer %s: not migrated (%s): %s", t.transfer_id, outcome, why)

    if s is None:
        give_up("not_resumable", stitch.refused or "decode's answer was not an event stream")
        return None
    if s.finish_reason is not None:
        flow.metrics.migration("completed")
        return s.tail()
    if (why := s.why_not()) is not None:
        give_up("not_resumable", why)
        return None
    if s.migrations >= flow.cfg.migration_limit:
        give_up("limit", f"--migration-limit {flow.cfg.migration_limit} reached")
        return None
    failed = {r.instance for r in t.retries if r.stage == "decode"} | {x.decode.url}
    available = [i.url for i in flow.decode.instances if i.available]
    if not available:
        give_up("no_instance", "no decode instance is available")
        return None
    if not flow.budget.take():
        give_up("budget", "the retry budget is spent")
        return None
    # Another decode where there is one; else the same one, if it is back.
    exclude = frozenset(failed) if set(available) - failed else frozenset()
    at = len(s.generated)
    retry = Retry("decode", "mid_stream", x.decode.url, error, t.transfer_id)
    body = s.continuation()
    started = await flow._start(
        x.server, body, COMPLETIONS_PATH, headers, (*t.retries, retry), None, None, exclude
    )
    if isinstance(started, Response):
        give_up("no_instance", "no decode could take the continuation")
        return None
    t.retried_as = started.tracker.transfer_id
    started.tracker.migrated_at_token = at
    started.tracker.migrated_from = x.decode.url
    flow.metrics.migration("resumed")
    log.warning(
        "transfer %s: decode %s broke off after %d tokens; the stream goes on as %s on %s",
        t.transfer_id,
        x.decode.url,
        at,
        started.tracker.transfer_id,
        started.decode.url,
    )
    return started, _continuation(flow, started, body, headers)


async def _continuation(
    flow: PDFlow, x: Exchange, body: dict[str, Any], headers: dict[str, str]
) -> AsyncIterator[bytes]:
    """The continuation's events, from its call to decode on."""
    req = flow._decode_request(x, body, COMPLETIONS_PATH, headers, None)
    x.upstream = await flow.client.send(req, stream=True)
    x.tracker.decode_status = x.upstream.status_code
    if x.upstream.status_code != 200:
        raise BrokenStream(f"its continuation was answered {x.upstream.status_code}")
    async for chunk in x.upstream.aiter_bytes():
        yield chunk
