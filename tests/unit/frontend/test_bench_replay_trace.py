"""`dualpath bench local --trace`: recorded prompts and partial hits replayed as scaled."""

from __future__ import annotations

from asgi_client import serving
from dualpath.config import local_default
from dualpath.frontend.app import create_app
from dualpath.frontend.backend import FakeBackend
from dualpath.local.bench import replay
from dualpath.trace import Trajectory, Turn

CFG = local_default()


async def test_recorded_prompts_and_a_compaction_are_sent_as_recorded() -> None:
    # Turn 2 compacts: it keeps only 128 tokens of the history, then 72 fresh ones.
    tr = Trajectory(
        "s",
        [
            Turn(300, 3, 0.0, prompt_tokens=300, hit_tokens=0),
            Turn(40, 3, 0.0, prompt_tokens=343, hit_tokens=256),
            Turn(-146, 3, 0.0, prompt_tokens=200, hit_tokens=128),
        ],
    )
    app = create_app(CFG, FakeBackend(CFG.spec.model, policy="dualpath"))
    async with serving(app) as c:
        res = await replay(c, [tr], CFG.spec.model.name, CFG.spec.model.vocab_size, seed=3)
    assert [r.prompt_tokens for r in res] == [300, 343, 200] and all(r.ok for r in res)
    # The compacted prompt re-uses only its first 128 tokens: the store hits no more than that.
    assert res[1].cached_tokens >= 256 and res[2].cached_tokens <= 128
