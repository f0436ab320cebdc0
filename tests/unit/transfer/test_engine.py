"""The NIXL engine's WRITE bookkeeping over a stand-in agent (no NIXL, no UCX): a WRITE whose
handle NIXL refuses to release is reported as possibly still in flight
(tests/integration/transfer/test_engine.py runs the engine against NIXL itself)."""

from __future__ import annotations

import pytest
from dualpath.transfer.base import TransferBase
from dualpath.transfer.engine import TransferEngine
from dualpath.transfer.pool import BufferPool
from dualpath.transfer.protocol import TransferError


class StuckAgent:
    """A NIXL agent whose WRITEs never complete; `cancellable`: whether it releases them."""

    def __init__(self, cancellable: bool) -> None:
        self.cancellable = cancellable
        self.released: list[object] = []

    def get_xfer_descs(self, descs, mem):  # noqa: ANN001, ANN201
        return descs

    def initialize_xfer(self, op, local, remote, peer, notif):  # noqa: ANN001, ANN201
        return object()

    def transfer(self, handle):  # noqa: ANN001, ANN201
        return "PROC"

    def check_xfer_state(self, handle):  # noqa: ANN001, ANN201
        return "PROC"

    def release_xfer_handle(self, handle):  # noqa: ANN001, ANN201
        if not self.cancellable:
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")
        self.released.append(handle)

    def remove_remote_agent(self, peer):  # noqa: ANN001, ANN201
        pass


def _engine(agent: StuckAgent) -> TransferEngine:
    engine = object.__new__(TransferEngine)  # no NIXL agent of its own
    TransferBase.__init__(engine, "t", "t-0", BufferPool(1 << 20), deadline_s=5)
    engine.agent = agent
    engine._leaked = []
    engine._reg = None
    engine._peers["peer"] = b""
    return engine


@pytest.mark.parametrize("cancellable", [True, False])
async def test_a_write_past_its_deadline_says_whether_it_may_still_land(cancellable):
    agent = StuckAgent(cancellable)
    engine = _engine(agent)
    region = engine.pool.alloc(4096)
    with pytest.raises(TransferError, match="deadline") as caught:
        await engine.write("peer", region.address, 4096, 1 << 40, deadline_s=0.05)
    assert caught.value.in_flight is not cancellable
    assert engine.stats.leaked_handles == (0 if cancellable else 1)
    assert len(agent.released) == (1 if cancellable else 0)
    assert not engine.knows("peer")
