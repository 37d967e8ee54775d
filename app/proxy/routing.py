"""What a request costs an instance, the prefix index, and the pick scores.

**Tokens in flight.** Every request the proxy sends is counted on its instance until it ends:
on decode ``prompt tokens + max_tokens`` (``max_completion_tokens``; absent: vLLM's default of
16 for completions, and ``DEFAULT_CHAT_MAX_TOKENS`` for chat, whose real limit is the context),
on prefill ``prompt tokens + 1`` (prefill generates one token). The proxy has no tokenizer:
a prompt given as token ids counts its ids, and so do chat messages an engine rendered to ids
for the proxy (chat_tokens.py); text (a completion prompt, chat messages that were not
rendered) counts ``len(text) // 4``, a rough English average.

**Prefix index (cache-aware prefill).** Per prefill instance an approximate, bounded (LRU)
set of hash chains of the prompts the proxy routed there: one hash per full block of
``block_size`` token ids, each hash covering its block and every block before it (as vLLM's
prefix cache keys its blocks). Text prompts are hashed in blocks of ``4 * block_size``
characters, so a block still stands for about ``block_size`` tokens. A chain starts from a
root naming the request's ``model`` (a LoRA adapter's name, or the base model's) and its
``cache_salt``, as vLLM keys both into every block hash: two tenants, or two adapters, never
share a chain, so a salted request is never scored on another tenant's prompts (a routing and
latency side channel the salt exists to close). Hit tokens = leading blocks present ×
``block_size``. It is what the proxy sent, not what the engine holds: an
engine that evicted, or restarted, is found out only by slower prefills. Decode instances
keep one too when the disaggregation hit rule is on (disagg.py): there it decides whether a
prompt needs a prefill at all, not where it goes.

**Score (cache_aware).** ``hit_tokens - alpha * tokens_in_flight``; the healthy instance with
the highest score wins, ties go to the next in rotation. With ``alpha = 1`` a cached token
and a queued token weigh the same (both are prefill compute that is, or is not, ahead of
this prompt): a prompt with 2k cached tokens on an instance with 10k tokens queued goes to an
idle one instead.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# Characters per token for text the proxy cannot tokenize (a rough English average).
CHARS_PER_TOKEN = 4
# vLLM's default max_tokens for /v1/completions.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Chat has no default but the context; a guess that makes long answers count for something.
DEFAULT_CHAT_MAX_TOKENS = 1024
# Chain seeds, so that a text block never matches a token block.
_TOKEN_SEED = 0x746F6B
_TEXT_SEED = 0x747874


@dataclass(frozen=True)
class RequestShape:
    """What routing needs of one request: its size and its prompt's block hash chain, and for
    precise hits (precise.py) its token ids (None: a text prompt), model and cache salt."""

    prompt_tokens: int
    max_tokens: int
    chain: tuple[int, ...]
    block_size: int
    token_ids: tuple[int, ...] | None = None
    model: str | None = None
    cache_salt: str | None = None
    # The prompt comes as embeddings (``prompt_embeds``): no token ids, no KV the sidecar moves.
    embeds: bool = False

    def cost(self, role: str) -> int:
        """Tokens in flight the request adds on an instance of ``role``."""
        if role == "prefill":
            return self.prompt_tokens + 1
        return self.prompt_tokens + self.max_tokens


@dataclass(frozen=True)
class Pick:
    """Why an instance was picked (shown in ``/health`` and the transfer record)."""

    url: str
    policy: str
    prompt_tokens: int
    # Tokens in flight this request adds: cache_aware, what is left to compute of it (the
    # prompt less the scored hit); else its whole cost.
    cost_tokens: int
    tokens_in_flight: int  # on the instance, before this request
    outstanding: int  # requests on the instance, before this request
    hit_tokens: int | None = None  # instances with a prefix index or KV events only
    score: float | None = None  # cache_aware only
    # Where the hit came from: "kv_events" (the engine's own, precise.py) or "approximate"
    # (the prefix index); the events' per-group hits and the group that ended the hit; why
    # an instance that publishes events was answered by the guess this time.
    hit_source: str | None = None
    hit_groups: dict[str, int] | None = None
    hit_limited_by: str | None = None
    hit_note: str | None = None
    # With the pool as second tier (pool_tier.py): what the pool serves of the prompt, the
    # tier the chosen instance's scored hit comes from ("engine" or "pool"), and why a pick
    # went without the pool.
    pool_hit_tokens: int | None = None
    hit_tier: str | None = None
    pool_note: str | None = None


def _is_token_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(i, int) for i in x)


def _chat_text(messages: Any) -> str:
    """The text of chat messages, role by role (image parts and the like are not counted)."""
    if not isinstance(messages, list):
        return ""
    parts: list[str] = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"{m.get('role', '')}\n{content if isinstance(content, str) else ''}\n")
    return "".join(parts)


def _root(seed: int, model: str | None, salt: str | None) -> int:
    """The hash a chain starts from: the kind of prompt, its adapter (``model``) and tenant."""
    return hash((seed, model, salt))


def _token_chain(ids: list[int], block_size: int, root: int) -> tuple[int, ...]:
    chain, h = [], root
    for i in range(0, len(ids) - block_size + 1, block_size):
        h = hash((h, tuple(ids[i : i + block_size])))
        chain.append(h)
    return tuple(chain)


def _text_chain(text: str, block_size: int, root: int) -> tuple[int, ...]:
    n = block_size * CHARS_PER_TOKEN
    chain, h = [], root
    for i in range(0, len(text) - n + 1, n):
        h = hash((h, text[i : i + n]))
        chain.append(h)
    return tuple(chain)


def _max_tokens(body: dict[str, Any], path: str) -> int:
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return v
    return DEFAULT_CHAT_MAX_TOKENS if "chat" in path else DEFAULT_COMPLETION_MAX_TOKENS


def shape_of(
    body: dict[str, Any],
    path: str,
    block_size: int,
    max_model_len: int = 1 << 62,
    chat_ids: Sequence[int] | None = None,
) -> RequestShape:
    """A request's size and hash chain from its body; a batch of prompts is hashed by its first.
    ``max_tokens`` counts up to what fits after the prompt in ``max_model_len``. ``chat_ids``:
    a chat request's messages as vLLM renders them (chat_tokens.py): the request is then
    shaped as the same prompt sent as ids is."""

    def fitting(max_tokens: int, prompt_tokens: int) -> int:
        return min(max_tokens, max(max_model_len - prompt_tokens, 0))

    model = body.get("model") if isinstance(body.get("model"), str) else None
    salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
    if "chat" in path and chat_ids is not None:
        rendered = list(chat_ids)
        return RequestShape(
            len(rendered),
            fitting(_max_tokens(body, path), len(rendered)),
            _token_chain(rendered, block_size, _root(_TOKEN_SEED, model, salt)),
            block_size,
            tuple(rendered),
            model,
            salt,
        )
    if "chat" in path:
        text = _chat_text(body.get("messages"))
        tokens = len(text) // CHARS_PER_TOKEN
        return RequestShape(
            tokens,
            fitting(_max_tokens(body, path), tokens),
            _text_chain(text, block_size, _root(_TEXT_SEED, model, salt)),
            block_size,
            model=model,
            cache_salt=salt,
        )
    # A prompt: text, token ids, or a batch of either.
    prompt = body.get("prompt")
    prompts: list[Any]
    if isinstance(prompt, str) or _is_token_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list):
        prompts = [p for p in prompt if isinstance(p, str) or _is_token_ids(p)]
    else:
        prompts = []
    sizes = [len(p) // CHARS_PER_TOKEN if isinstance(p, str) else len(p) for p in prompts]
    tokens = sum(sizes)
    chain: tuple[int, ...] = ()
    ids: tuple[int, ...] | None = None
    if prompts:
        first = prompts[0]
        if isinstance(first, str):
            chain = _text_chain(first, block_size, _root(_TEXT_SEED, model, salt))
        else:
            chain = _token_chain(first, block_size, _root(_TOKEN_SEED, model, salt))
            ids = tuple(first)
    # Every prompt of a batch generates its own answer.
    answers = fitting(_max_tokens(body, path), max(sizes, default=0)) * max(1, len(prompts))
    embeds = body.get("prompt_embeds") is not None
    return RequestShape(tokens, answers, chain, block_size, ids, model, salt, embeds)


class PrefixIndex:
    """The block hashes routed to one instance, least recently routed evicted first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def hit_blocks(self, chain: Iterable[int]) -> int:
        """How many leading blocks of ``chain`` are here (a chain hash implies its prefix)."""
        return _leading(chain, self._blocks)

    def add(self, chain: Sequence[int]) -> None:
        # Last block first: a chain's head ends up the most recent, so eviction eats its
        # tail (useless without the head) before its head.
        for h in reversed(chain):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


class InFlightPrefixes:
    """The block hash chains of the requests in flight on one instance (a multiset): what its
    engine is about to store, before its KV events can say so."""

    def __init__(self) -> None:
        self._count: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._count)

    def add(self, chain: Sequence[int]) -> None:
        for h in chain:
            self._count[h] = self._count.get(h, 0) + 1

    def remove(self, chain: Sequence[int]) -> None:
        for h in chain:
            left = self._count[h] - 1
            if left:
                self._count[h] = left
            else:
                del self._count[h]

    def hit_blocks(self, chain: Iterable[int]) -> int:
        """How many leading blocks of ``chain`` a request in flight here shares."""
        return _leading(chain, self._count)


def _leading(chain: Iterable[int], held: Container[int]) -> int:
    n = 0
    for h in chain:
        if h not in held:
            break
        n += 1
    return n


def cache_score(hit_tokens: float, tokens_in_flight: int, alpha: float) -> float:
    """The cache-aware score: cached prompt tokens minus the weighted load ahead."""
    return hit_tokens - alpha * tokens_in_flight
