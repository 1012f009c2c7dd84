"""A sliding-window model keeps its conversations across a rolling restart (issue 33, point 3):
the real Gemma 3 270M file (5 of every 6 layers sliding-window, n_swa 512), the real
llama-server, planner, agent and gateway.

Its lanes' windows are at their ceiling, so the planner gives them --swa-full (it costs no
window); each lane saves its slots before a rolling `config set threads=...` and restores them
before it serves, and the next turn of every conversation is served mostly from cache. Without
--swa-full a restored sliding-window slot is prefilled again in full (cached 0 before this).
"""

from __future__ import annotations

import random
import shutil

from fixtures_bus import fleet_status
from test_slot_save_real import _text, slot_fleet, warm_then_roll

from shared.messages.config import Demand, Persona

CONVERSATIONS = 4


async def test_gemma_lanes_keep_each_conversations_cache_across_a_rolling_restart(nats_server, tmp_path, llama_server,
                                                                                  gemma_model):  # fmt: skip
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(gemma_model, models / "m.gguf")
    demand = Demand(personas=(Persona(model="m", alias="m", lanes=2, parallel=2, ctx_min=2048, ctx_max=2048),))
    rng = random.Random(33)
    async with slot_fleet(nats_server.url, tmp_path, models, llama_server, demand, "gemma") as f:
        nc, gw, http, events = f.nc, f.gw, f.http, f.events
        plans = [lane for p in (await fleet_status(nc)).plans for lane in p.lanes]
        assert all(x.swa_full for x in plans), [x.reasons for x in plans]
        running = [lane for st in (await fleet_status(nc)).statuses for lane in st.lanes]
        assert all("--swa-full" in x.argv for x in running) and len(running) == 2
        # Longer than the 512-token sliding window: the restored slots must hold all of it.
        prompts = [f"conversation {i}\nsystem: " + _text(rng, 6000) for i in range(CONVERSATIONS)]
        await warm_then_roll(nc, gw, http, prompts, rng, events, "Gemma ")
        statuses = (await fleet_status(nc)).statuses
        assert not [fb for st in statuses for fb in st.feedback if fb.kind == "over_plan"]  # the KV as planned
