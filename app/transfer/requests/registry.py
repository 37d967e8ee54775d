"""Engine ranks registering their KV memory, and the generations that re-registrations start.

A rank that registers again while its previous registration is of the current epoch means its
engine restarted: a new *generation* begins (a new epoch). Every request of the old one fails,
its memory is unregistered, and every peer is told (``NewEpoch``) and answers once nothing of
its is on the wire to the old memory; only then is the new memory registered, so that a late
write can never land in it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.devices.bell import Bell
from app.devices.events import SidecarRing
from app.devices.fdpass import receive_fds
from app.devices.memory import ImportedMemory, check_device_type, import_buffer
from app.devices.shm import MappedFile, map_engine_fd, map_engine_file
from app.devices.spec import EventRingSpec, FdSource
from app.errors import ConfigError, KVSidecarError
from app.kvcache.engine_layout import describe_engine
from app.kvcache.engine_spec import EngineRegistration, MemorySpan
from app.store.rank_pool import RankPool
from app.store.service import PoolService
from app.transfer.control.peers import Peer, Peers
from app.transfer.lanes.mooncake import MooncakeEngine
from app.transfer.requests.agent import Agent, SendRequest
from app.transfer.requests.integrity import kv_memory
from app.transfer.requests.stream import StreamThread
from app.transfer.wire.protocol import Msg, NewEpoch, Reply, Status

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegistrySettings:
    """What the registry reads of the sidecar's settings."""

    engine_id: str
    ranks: tuple[int, ...]
    tp_size: int
    device_type: str
    # how long a peer gets to confirm a new epoch
    lease_s: float


class Registry:
    """The ranks' registrations of one sidecar, and its epoch."""

    def __init__(
        self,
        settings: RegistrySettings,
        agents: dict[int, Agent],
        peers: Peers,
        *,
        stream_for: Callable[[Agent], StreamThread],
        drained: Callable[[SendRequest], Awaitable[bool]],
        control_port: Callable[[], int],
    ) -> None:
        self.settings, self.agents, self._peers = settings, agents, peers
        self._stream_for, self._drained, self._control_port = stream_for, drained, control_port
        self.engine: MooncakeEngine | None = None
        self.pool: PoolService | None = None
        self.epoch = secrets.token_hex(8)
        self.generation = 0
        self.compat_hash = ""
        self.speculative = ""  # the engine's speculative decoding settings ("" when off)
        self.tp_size = settings.tp_size

    async def register_engine(self, reg: EngineRegistration) -> Msg:
        """Regions, groups and pieces from the engine's own tensors (DESIGN §2a)."""
        self._check_rank(reg.rank)
        imported: list[ImportedMemory] = []
        buffers: Sequence[torch.Tensor | MappedFile]
        if reg.device_memory is not None:
            if len(reg.device_memory) != len(reg.memory):
                raise ConfigError(
                    f"rank {reg.rank} registered {len(reg.memory)} memory spans and "
                    f"{len(reg.device_memory)} device buffers; one buffer per span"
                )
            check_device_type(self.settings.device_type, reg.rank, reg.device_memory)
            imported = [import_buffer(b) for b in reg.device_memory]
            buffers = [m.tensor for m in imported]
        elif reg.memory_fds is not None:
            buffers = await asyncio.to_thread(_map_served, reg.memory_fds, reg.memory)
        else:
            buffers = [map_engine_file(s.name, s.offset + s.size) for s in reg.memory]
        # Only memory we could open starts a new generation: a refusal changes nothing.
        await self._new_generation_if_restarted(reg.rank)
        try:
            desc = describe_engine(
                reg, [b.data_ptr() + s.offset for b, s in zip(buffers, reg.memory, strict=True)]
            )
            ring = self._open_ring(reg.rank, reg.events, len(desc.placements))
        except BaseException:
            _close(imported)
            raise
        if self.compat_hash and (desc.compat_hash, reg.speculative) != (
            self.compat_hash,
            self.speculative,
        ):
            _close(imported)
            return Reply(
                ok=False,
                error=f"rank {reg.rank} registered model {desc.compat_hash} (speculative: "
                f"{reg.speculative or 'off'}), its siblings {self.compat_hash} (speculative: "
                f"{self.speculative or 'off'}); every rank of one sidecar must run the same model",
            )
        assert self.engine is not None
        spans = [
            (b.data_ptr() + s.offset, s.size) for b, s in zip(buffers, reg.memory, strict=True)
        ]
        await asyncio.to_thread(self.engine.register_many, spans)
        memory = kv_memory(spans, [m.tensor for m in imported])
        if self.pool is not None:
            rank_pool = RankPool.from_engine(desc, reg, spans, self.pool.namespace, memory=memory)
            await self.pool.register(rank_pool)
        agent = Agent(None, desc, reg.engine_id)
        agent.memory = buffers  # the mappings live as long as the agent
        agent.device_memory = imported
        agent.digest_memory = memory
        agent.registration = reg
        agent.events = ring
        agent.bell = _open_bell(reg)
        await self._install(agent)
        self.compat_hash = desc.compat_hash
        self.speculative = reg.speculative
        self.tp_size = reg.tp_size
        log.info(
            "rank %d registered %s: %d layers in %d groups, %d blocks, %d regions",
            reg.rank,
            reg.model,
            len(desc.placements),
            len(desc.groups),
            desc.num_blocks,
            len(desc.regions),
        )
        return Reply(
            data={
                "epoch": self.epoch,
                "control_port": self._control_port(),
                "num_blocks": desc.num_blocks,
                "compat_hash": desc.compat_hash,
                "pool_tails": self.pool is not None and self.pool.stores_tails(reg.rank),
                "bell": agent.bell is not None,
            }
        )

    def _check_rank(self, rank: int) -> None:
        if rank not in self.settings.ranks:
            raise ConfigError(
                f"rank {rank} registered, this sidecar hosts ranks {list(self.settings.ranks)}; "
                "set the sidecar's ranks to the engine ranks in its pod"
            )

    def _open_ring(self, rank: int, spec: EventRingSpec | None, layers: int) -> SidecarRing | None:
        """Open the rank's event ring once, at registration (None: it registered none)."""
        if spec is None:
            return None
        if spec.layers != layers:
            raise ConfigError(
                f"rank {rank}'s event ring has {spec.layers} layers, its KV cache {layers}; "
                "the engine must make one ring row per layer it signals"
            )
        return SidecarRing.open(spec)

    async def _install(self, agent: Agent) -> None:
        assert self.engine is not None
        agent.epoch = self.epoch
        agent.stream = self._stream_for(agent)
        old = self.agents.pop(agent.rank, None)
        if old is not None:
            agent.history = old.history
            if old.stream:
                await asyncio.to_thread(old.stream.stop)
            # Its memory was unregistered with its generation; let go of the mappings now,
            # not when a reference cycle through the old stream thread is collected (the dead
            # engine's segments stayed mapped for seconds).
            old.memory = ()
            _close(old.device_memory)
            old.device_memory = []
            old.events = None  # its table stays mapped while a late task still holds it
            if old.bell is not None:  # the old engine's file: its ended requests may ring late
                old.bell.close()
            old.layout = None
            old.stream = None
        self.agents[agent.rank] = agent

    async def _new_generation_if_restarted(self, rank: int) -> None:
        """A rank registering again within its epoch means a new engine process."""
        old = self.agents.get(rank)
        if old is None or old.epoch != self.epoch:
            return
        old_epoch, self.epoch = self.epoch, secrets.token_hex(8)
        self.generation += 1
        why = (
            f"engine rank {rank} registered again (generation {self.generation}): its old "
            "memory is gone"
        )
        log.warning(
            "%s; new epoch %s, failing every request of epoch %s", why, self.epoch, old_epoch
        )
        ended = []
        for agent in self.agents.values():
            for req in agent.all_requests():
                if req.finish(Status.FAILED, why):
                    ended.append(req)
        for req in ended:
            if isinstance(req, SendRequest):
                req.peer_lost = True
                await self._drained(req)
        for agent in self.agents.values():
            agent.retire()  # the old engine cannot take reports; they go to the history
        assert self.engine is not None
        await asyncio.to_thread(self.engine.unregister_all)
        # Until each peer answered, it may still write to the old addresses, which the new
        # registration could reuse.
        note = NewEpoch(engine_id=self.settings.engine_id, old=old_epoch, new=self.epoch)
        peers = list(self._peers.table.values())
        await asyncio.gather(*(self._tell_new_epoch(p, note) for p in peers))
        # Their planners hold our old addresses: the next request handshakes anew.
        for peer in peers:
            await self._peers.drop(peer)
        self.compat_hash = self.speculative = ""

    async def _tell_new_epoch(self, peer: Peer, note: NewEpoch) -> None:
        try:
            await peer.client.request(note, self.settings.lease_s)
        except KVSidecarError as e:
            log.warning("peer %s did not confirm the new epoch: %s", peer.endpoint, e)


def _open_bell(reg: EngineRegistration) -> Bell | None:
    """The engine's finished bell, mapped; None (the engine then asks every time) when it named
    none or it cannot be mapped (no /dev/shm shared with it)."""
    if reg.bell is None:
        return None
    try:
        return Bell.open(reg.bell)
    except (ConfigError, OSError) as e:
        log.warning("rank %d: no finished bell (%s); the engine asks every step", reg.rank, e)
        return None


def _close(memory: list[ImportedMemory]) -> None:
    """Unmap imported device memory that no agent will hold (or holds no longer)."""
    for mem in memory:
        mem.close()


def _map_served(source: FdSource, spans: list[MemorySpan]) -> list[MappedFile]:
    """The engine's files, as the descriptors it serves (a re-registration), mapped whole."""
    fds = receive_fds(source.socket, source.token, len(spans))
    try:
        return [
            map_engine_fd(fd, s.offset + s.size, s.name) for fd, s in zip(fds, spans, strict=True)
        ]
    finally:
        for fd in fds:
            os.close(fd)
