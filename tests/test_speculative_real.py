"""Speculative decoding with the real llama-server: a lane with a draft model and a lane with an
n-gram speculator, planned, launched by the agent, served through the gateway (the `openai`
client), and their buffers per device exactly as the binary prints them."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import msgspec
import openai
import psutil
import pytest
from fixtures_bus import agent_config, client, fleet_status, free_port_base, host_status, lane_of, services
from test_real_llama import _planner_with
from tinymodels import write_llama
from waiting import eventually

from gateway.service import Gateway, run_gateway
from gateway.settings import GatewaySettings
from shared.gguf_facts import read_model_facts
from shared.llama.logs import DeviceBuffers, parse_buffers
from shared.llama.printed import compare
from shared.memory import LaneShape, lane_memory
from shared.memory.speculative import draft_shape, speculator_host_bytes, target_shape, with_speculation
from shared.messages.config import Demand, Persona

MIB = 2**20


def _printed(devices) -> DeviceBuffers:
    """The agent's printed figures (LaneStatus.devices) as parse_buffers gives them."""
    out = DeviceBuffers()
    for d in devices:
        out.mib[d.device] = {"model": d.model_bytes / MIB, "KV": d.kv_bytes / MIB, "compute": d.compute_bytes / MIB,
                             "output": d.output_bytes / MIB}  # fmt: skip
    return out


async def test_draft_and_ngram_lanes_serve_through_the_gateway(nats_server, tmp_path, llama_server):
    models = tmp_path / "models"
    models.mkdir()
    write_llama(models / "target.gguf", n_layer=4, n_embd=256, n_vocab=32000, seed=1)
    write_llama(models / "draft.gguf", n_layer=2, n_embd=256, n_vocab=32000, seed=2)
    demand = Demand(personas=(
        Persona(model="target", speculative="draft-simple", draft="draft", parallel=2, ctx_max=2048),
        Persona(model="draft", alias="ngram", speculative="ngram-mod", ctx_max=2048),
    ))  # fmt: skip
    gw = Gateway(GatewaySettings(port=0))
    stop = asyncio.Event()
    async with services(nats_server.url) as s, client(nats_server.url) as nc:
        await _planner_with(nc, s, {}, demand)
        s.start_agent(agent_config(tmp_path, "spec", models, llama_server))
        task = asyncio.create_task(run_gateway(nats_server.url, stop, gateway=gw))
        try:
            await eventually(lambda: gw.view.routable("target") and gw.view.routable("ngram"), timeout=120,
                             what="both lanes routable")  # fmt: skip
            specs = {spec.alias: spec for spec in (await fleet_status(nc)).plans[0].lanes}

            async def printed():  # the agent reads a lane's buffer lines from its log: wait for both lanes'
                got = await host_status(nc, "spec")
                lanes = [lane_of(got, s.lane_id) for s in specs.values()]
                return got if all(x is not None and x.devices and x.kv_bytes is not None for x in lanes) else None

            status = await eventually(printed, timeout=60, what="both lanes' printed buffers")
            running = {lane.lane_id: psutil.Process(lane.pid).cmdline() for lane in status.lanes}
            ai = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            for model in ("target", "ngram"):
                answer = await ai.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "repeat: a b c a b c a b c"}], max_tokens=24
                )
                assert answer.choices[0].message is not None and answer.usage.completion_tokens > 0
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)

    target, ngram = specs["target"], specs["ngram"]
    assert target.spec_type == "draft-simple" and target.draft_model == "draft"
    assert ngram.spec_type == "ngram-mod" and not ngram.draft_path
    for spec in (target, ngram):
        lane = lane_of(status, spec.lane_id)
        argv = running[spec.lane_id]
        assert argv[argv.index("--spec-type") + 1] == spec.spec_type
        assert not any(a.startswith("--draft") for a in argv)  # the removed flags are never passed
        # every buffer on every device as the binary printed it, the draft's included (its own lines)
        checks = compare(spec.memory.devices, _printed(lane.devices))
        assert checks and all(c.ok for c in checks), checks
        assert lane.kv_bytes == spec.memory.kv_bytes or abs(lane.kv_bytes - spec.memory.kv_bytes) <= 0.005 * MIB + 1
    argv = running[target.lane_id]
    assert argv[argv.index("--spec-draft-model") + 1] == target.draft_path
    assert target.memory.draft_bytes > 0 and ngram.memory.speculator_bytes >= 16 * MIB


@pytest.mark.parametrize("n_max", [None, 8])
def test_a_draft_with_its_own_cache_types_is_planned_as_printed(tmp_path, llama_server, n_max):
    """The draft's K/V types (-ctkd/-ctvd) size its cache: q8_0 for the draft, f16 for the target,
    two slots, every printed buffer equal to the plan (shared/memory/speculative.py); with a longer
    draft (--spec-draft-n-max 8) the target reserves more outputs. `lanes estimate`, given the same
    flags as llama-server spells them, says the same figures."""
    target = write_llama(tmp_path / "target.gguf", n_layer=4, n_embd=256, n_vocab=32000, seed=1)
    draft = write_llama(tmp_path / "draft.gguf", n_layer=2, n_embd=256, n_vocab=32000, seed=2)
    flags = ["--ctx-size", "4096", "--parallel", "2", "--flash-attn", "on", "--spec-type", "draft-simple",
             "--spec-draft-model", str(draft), "--spec-draft-ngl", "0", "--spec-draft-type-k", "q8_0",
             "--spec-draft-type-v", "q8_0", *(["--spec-draft-n-max", str(n_max)] if n_max else [])]  # fmt: skip
    argv = [llama_server, "--model", str(target), "--host", "127.0.0.1", "--port", str(free_port_base(1)),
            "--n-gpu-layers", "0", "-fit", "off", *flags, "--verbosity", "4"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "model loaded" in line:
                break
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert any("model loaded" in line for line in lines), lines[-5:]
    base = LaneShape(ctx=4096, parallel=2, flash_attn=True)
    planned = with_speculation(
        lane_memory(read_model_facts(target), target_shape(base, "draft-simple", n_max)),
        lane_memory(read_model_facts(draft), draft_shape(base, "q8_0", "q8_0")),
        speculator_host_bytes("draft-simple", 32000, 2, base.n_ubatch, n_max),
    )
    checks = compare(planned.devices, parse_buffers(lines))
    assert {c.kind for c in checks} == {"model", "KV", "compute", "output"}
    assert all(c.ok for c in checks), checks
    assert any("K (q8_0)" in line for line in lines)  # the draft's cache is the q8_0 one
    estimate = [a.replace("--ctx-size", "--ctx") for a in flags if a not in ("--spec-draft-ngl", "0")]
    run = subprocess.run([sys.executable, "-m", "lanes.cli", "estimate", str(target), *estimate, "--json"],
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr
    said = json.loads(run.stdout)
    assert [(d["device"], d["model_bytes"], d["kv_bytes"], d["compute_bytes"], d["output_bytes"], d["draft_bytes"])
            for d in said["devices"]] == [(d.device, d.model_bytes, d.kv_bytes, d.compute_bytes, d.output_bytes,
                                           d.draft_bytes) for d in planned.devices]  # fmt: skip
    assert said["speculator_bytes"] == planned.speculator_bytes > 0


DRAFT_DEVICE_CASES = [  # (-devd, -ts for the lane, the GPUs the draft lands on)
    ("RPC1", "1,1", {"GPU1"}),
    ("RPC1,RPC0", "3,1", {"GPU0", "GPU1"}),
    ("RPC1,RPC0", "1,0", {"GPU1"}),  # every layer of both on one device of two: each still pipelined
    ("none", "1,1", set()),
]


@pytest.mark.parametrize("case", DRAFT_DEVICE_CASES, ids=lambda c: f"{c[0]}-ts{c[1]}")
def test_a_draft_on_its_own_devices_is_estimated_as_printed(tmp_path, rpc_bin, case):
    """-devd puts the draft on the devices it names, in its order (the lane's -ts read by position
    over them: with 3,1 the draft's blocks on RPC1, its output layer on RPC0), or on none: `lanes
    estimate` with the same flags says per device what the real binary prints with two RPC devices,
    the target's buffers and the draft's. Two devices in the draft's list pipeline its graph
    even where one holds every layer (model.n_devices(), llama-context.cpp)."""
    from record_llama_figures import run_until_loaded
    from rpc_harness import rpc_servers

    devd, split, lands_on = case
    target = write_llama(tmp_path / "target.gguf", n_layer=4, n_embd=256, n_vocab=32000, seed=1)
    draft = write_llama(tmp_path / "draft.gguf", n_layer=4, n_embd=128, n_vocab=32000, seed=2)
    flags = ["--ctx-size", "2048", "--parallel", "2", "--flash-attn", "on", "--spec-type", "draft-simple",
             "--spec-draft-model", str(draft), "--spec-draft-ngl", "all", "-devd", devd, "-ngl", "all", "-ts", split]  # fmt: skip
    server = str(rpc_bin / "llama-server")
    with rpc_servers(rpc_bin, 2) as eps:
        lines = run_until_loaded([server, "-m", str(target), "--rpc", ",".join(eps), "--port", "0", "-fit", "off",
                                  "--verbosity", "4", *flags])  # fmt: skip
    assert any("model loaded" in line for line in lines), lines[-5:]
    run = subprocess.run([sys.executable, "-m", "lanes.cli", "estimate", str(target), "--gpus", "16GiB,16GiB",
                          "--llama-server", server, "--json", *(a.replace("--ctx-size", "--ctx") for a in flags)],
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr
    from shared.messages.plans import MemoryBreakdown

    said = msgspec.convert(json.loads(run.stdout), MemoryBreakdown, strict=False)
    checks = compare(said.devices, parse_buffers(lines))
    assert {c.kind for c in checks} == {"model", "KV", "compute", "output"}
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]
    on = {d.device for d in said.devices if d.draft_bytes and d.index >= 0}
    assert on == lands_on, said.devices
