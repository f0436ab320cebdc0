"""NIXL between two vLLM instances: one agent per vLLM worker process over vLLM's own paged KV
cache (no staging buffer), driven synchronously from vLLM's forward thread.

Each layer's cache tensor is registered as one region (`register_kv_caches`). vLLM's CPU cache
is (num_blocks, heads, block_size, 2 * head_dim) per layer, so one vLLM block of one layer is
contiguous: `block_bytes` at `base + block * block_bytes`, and a transfer is one descriptor
per (layer, block) (`block_descs`, pure). A sender (prefill) READs the hit from the decode's
blocks (path D) and WRITEs the blocks the decode lacks, then notifies the transfer's id; the
receiver (decode) only polls notifications.
Path D's pipeline: each agent also registers `PROGRESS_SLOTS` 8-byte progress words. A
receiver reading its hit from the store publishes in its word how many layers are in its cache
and how many tokens of the hit are valid (`progress_word`, pure); the sender READs that word
(`read_progress`) and reads layer l as soon as the word says it is there, while the receiver
reads layer l+1 from the store. One more word is where a sender's polls land (only vLLM's
forward thread polls). As in `dualpath.transfer.engine`: UCX backend, no
progress thread (progress is driven by the polls), every wait bounded by a deadline, a failed
transfer raises `TransferError` naming the peer, and the handle is released (or kept and
released later when UCX cannot cancel it yet).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Sequence

import torch

from dualpath.integrations.vllm.plan import KvTarget
from dualpath.transfer.protocol import TransferError, release_leaked

log = logging.getLogger(__name__)

POLL_S = 0.0005  # a waiting transfer's poll period after its first spin
PROGRESS_SLOTS = 1024  # receivers a decode instance can stream at once (and a sender's polls)
_TOKENS_BITS = 32


def progress_word(layers: int, tokens: int) -> int:
    """A receiver's progress: `layers` layers of the hit are in its cache, each holding the
    hit's first `tokens` tokens (both only ever grow and shrink, respectively)."""
    return (layers << _TOKENS_BITS) | tokens


def progress_of(word: int) -> tuple[int, int]:
    """(layers, tokens) of a progress word."""
    return word >> _TOKENS_BITS, word & ((1 << _TOKENS_BITS) - 1)


def block_descs(
    base: int, block_bytes: int, block_ids: Sequence[int]
) -> list[tuple[int, int, int]]:
    """NIXL DRAM descriptors (address, bytes, device 0) of `block_ids` of one layer's cache."""
    return [(base + b * block_bytes, block_bytes, 0) for b in block_ids]


class KvAgent:
    """A NIXL agent over one vLLM instance's per-layer KV cache tensors."""

    def __init__(self, node_id: str, caches: dict[int, torch.Tensor]) -> None:
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        from dualpath.log import quiet_nixl_logs

        quiet_nixl_logs()
        self.name = f"{node_id}-vllm-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.agent = nixl_agent(
            self.name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        )
        if "UCX" not in self.agent.backends:
            raise RuntimeError("NIXL has no UCX backend plugin")
        self.layers = len(caches)
        t = caches[0]
        self.block_bytes = t[0].numel() * t.element_size()
        self.layer_addresses = tuple(caches[i].data_ptr() for i in range(self.layers))
        for i in range(self.layers):
            c = caches[i]
            if not c.is_contiguous() or c[0].numel() * c.element_size() != self.block_bytes:
                raise ValueError(f"vLLM's KV cache of layer {i} is not contiguous blocks")
        # [0, SLOTS): receivers' progress words; [SLOTS]: where a sender's polls land
        self.progress = torch.zeros(PROGRESS_SLOTS + 1, dtype=torch.int64)
        self._free_slots = list(range(PROGRESS_SLOTS))
        regions = [(caches[i].data_ptr(), caches[i].nbytes, 0, "") for i in range(self.layers)]
        regions.append((self.progress.data_ptr(), self.progress.nbytes, 0, ""))
        self._reg = self.agent.register_memory(regions, "DRAM")
        self.metadata: bytes = self.agent.get_agent_metadata()
        self._peers: dict[str, str] = {}  # target agent name -> NIXL's name of it
        self._leaked: list = []

    def target(self, block_ids: Sequence[int], slot: int | None = None) -> KvTarget:
        """This cache as a sender addresses it (the receiver's side of the rendezvous); `slot`:
        the progress word the sender polls before reading each layer (None: the hit is
        already in the cache)."""
        progress = 0 if slot is None else self.progress[slot:].data_ptr()
        return KvTarget(
            self.name,
            self.metadata,
            self.layer_addresses,
            self.block_bytes,
            tuple(block_ids),
            progress,
        )

    def take_slot(self, layers: int, tokens: int) -> int | None:
        """A progress word for one receiver, set to (layers, tokens); None when all are taken
        (the receiver then reads its whole hit before it answers: no pipeline)."""
        if not self._free_slots:
            return None
        slot = self._free_slots.pop()
        self.set_progress(slot, layers, tokens)
        return slot

    def set_progress(self, slot: int, layers: int, tokens: int) -> None:
        # the layer's KV is written before this store: x86 keeps stores in order
        self.progress[slot] = progress_word(layers, tokens)

    def give_slot(self, slot: int) -> None:
        self._free_slots.append(slot)

    def read_progress(self, t: KvTarget, deadline_unix: float) -> tuple[int, int]:
        """(layers, tokens) of the receiver's progress word at `t.progress_address`."""
        local = [(self.progress[PROGRESS_SLOTS:].data_ptr(), 8, 0)]
        handle = self._post("READ", t, local, [(t.progress_address, 8, 0)], "progress word")
        self.wait(handle, deadline_unix, f"progress of {t.agent}")
        return progress_of(int(self.progress[PROGRESS_SLOTS]))

    def _peer(self, t: KvTarget) -> str:
        if t.block_bytes != self.block_bytes or len(t.layer_addresses) != self.layers:
            raise TransferError(
                f"peer {t.agent}: {len(t.layer_addresses)} layers of {t.block_bytes}-byte "
                f"blocks; this cache has {self.layers} of {self.block_bytes}"
            )
        peer = self._peers.get(t.agent)
        if peer is None:
            try:
                name = self.agent.add_remote_agent(t.metadata)
            except Exception as err:  # the bindings raise plain exceptions
                raise TransferError(f"NIXL metadata of {t.agent} refused: {err}") from err
            peer = self._peers[t.agent] = name.decode() if isinstance(name, bytes) else name
        return peer

    def post(self, op: str, t: KvTarget, layer: int, local: Sequence[int], remote: Sequence[int]):  # noqa: ANN201 (a nixl transfer handle)
        """Start a READ (remote -> local) or WRITE (local -> remote) of one layer's blocks."""
        if len(local) != len(remote):
            raise ValueError(f"{len(local)} local blocks for {len(remote)} remote blocks")
        return self._post(
            op,
            t,
            block_descs(self.layer_addresses[layer], self.block_bytes, local),
            block_descs(t.layer_addresses[layer], t.block_bytes, remote),
            f"layer {layer}",
        )

    def _post(self, op: str, t: KvTarget, local: list, remote: list, what: str):  # noqa: ANN201
        peer = self._peer(t)
        try:
            ldesc = self.agent.get_xfer_descs(local, "DRAM")
            rdesc = self.agent.get_xfer_descs(remote, "DRAM")
            handle = self.agent.initialize_xfer(op, ldesc, rdesc, peer, b"")
            state = self.agent.transfer(handle)
        except Exception as err:
            self._drop(t.agent)
            raise TransferError(f"{op} of {what} with {t.agent} failed: {err}") from err
        if state not in ("PROC", "DONE"):
            self.release(handle)
            raise TransferError(f"{op} of {what} with {t.agent} failed (state {state})")
        return handle

    def wait(self, handle, deadline_unix: float, what: str) -> None:  # noqa: ANN001
        """Drive `handle` to DONE; TransferError past the deadline or on an error state.
        The handle is released either way."""
        ok = False
        try:
            state = self.agent.check_xfer_state(handle)
            while state == "PROC":
                if time.time() > deadline_unix:
                    raise TransferError(f"{what} did not complete by its deadline")
                time.sleep(POLL_S)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"{what} failed (state {state})")
            ok = True
        finally:
            self.release(handle)
            if not ok:
                log.debug("%s: handle released after a failure", what)

    def done(self, handle, deadline_unix: float, what: str) -> bool:  # noqa: ANN001
        """Whether `handle` is DONE, never blocking (a parked request's reads, polled each
        step); released once done; TransferError past the deadline or on an error state."""
        state = self.agent.check_xfer_state(handle)
        if state == "PROC" and time.time() <= deadline_unix:
            return False
        self.release(handle)
        if state == "DONE":
            return True
        if state == "PROC":
            raise TransferError(f"{what} did not complete by its deadline")
        raise TransferError(f"{what} failed (state {state})")

    def notify(self, t: KvTarget, msg: bytes) -> None:
        try:
            self.agent.send_notif(self._peer(t), msg)
        except TransferError:
            raise
        except Exception as err:
            raise TransferError(f"notification to {t.agent} failed: {err}") from err

    def notifications(self) -> list[bytes]:
        """New notifications from every peer (also UCX progress for incoming transfers)."""
        try:
            got = self.agent.get_new_notifs()
        except Exception as err:  # a poll failure: the receivers' deadlines still hold
            log.warning("NIXL notification poll failed: %s", err)
            return []
        if self._leaked:
            self._retry_releases()
        return [bytes(m) for msgs in got.values() for m in msgs]

    def release(self, handle) -> None:  # noqa: ANN001
        try:
            self.agent.release_xfer_handle(handle)
        except Exception as err:  # still in flight and not cancellable yet: retry later
            log.debug("xfer handle release deferred: %s", err)
            self._leaked.append(handle)

    def _retry_releases(self) -> None:
        self._leaked = release_leaked(self.agent, self._leaked)

    def _drop(self, agent: str) -> None:
        peer = self._peers.pop(agent, None)
        if peer is not None:
            try:
                self.agent.remove_remote_agent(peer)
            except Exception as err:
                log.debug("remove_remote_agent(%s): %s", peer, err)

    def close(self) -> None:
        if self._reg is None:
            return
        self._retry_releases()
        for agent in list(self._peers):
            self._drop(agent)
        try:
            self.agent.deregister_memory(self._reg)
        except Exception as err:
            log.warning("deregistering vLLM's KV cache from NIXL failed: %s", err)
        self._reg = None
