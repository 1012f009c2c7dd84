"""Rolling upgrades and model folders: plans from a planner one schema apart, args checked by
meaning, n_ubatch on the command line, symlinked (Hugging Face) model folders."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import msgspec
import pytest

from launcher_agent.config import AgentConfig
from launcher_agent.reconcile import in_model_folders, validate_plan
from launcher_agent.supervisor import Supervisor, model_file_exists
from planner_svc.planner import plan
from shared.gguf_facts import scan_models
from shared.llama.flags import lane_args
from shared.messages.config import FleetConfig
from shared.messages.hosts import HostReport, ServerCaps
from shared.messages.plans import HostPlan
from shared.messages.wire import SCHEMA_VERSION

CAPS = ServerCaps()
PORTS = range(8080, 8096)


def _report(folder: Path) -> HostReport:
    models, problems = scan_models([str(folder)])
    assert not problems and models
    return HostReport(host_id="h1", cpu_cores=4, ram_total=16 * 2**30, ram_available=12 * 2**30, server=CAPS,
                      models=tuple(models))  # fmt: skip


def _plan(folder: Path, config: FleetConfig = FleetConfig()) -> HostPlan:
    (host,) = plan([_report(folder)], config).hosts
    assert host.lanes, host
    return host


def _check(p: HostPlan, folder: Path) -> str | None:
    return validate_plan(p, host_id="h1", model_dirs=[str(folder)], port_range=PORTS, caps=CAPS, applied_revision=0,
                         model_exists=model_file_exists)  # real folders with links: the agent's own check


@pytest.fixture
def folder(models) -> Path:
    return models


def _as_previous_schema(p: HostPlan) -> bytes:
    """The plan as the previous planner wrote it: schema 1, lane specs without n_ubatch."""
    raw = msgspec.to_builtins(p)
    raw["schema"] = SCHEMA_VERSION - 1
    for lane in raw["lanes"]:
        del lane["n_ubatch"]
    return msgspec.json.encode(raw)


async def test_a_plan_in_the_previous_schema_is_accepted_and_launched_as_rendered(folder, tmp_path):
    old = msgspec.json.decode(_as_previous_schema(_plan(folder)), type=HostPlan)
    assert old.schema == SCHEMA_VERSION - 1 and old.lanes[0].args  # an older planner rendered argv
    assert _check(old, folder) is None
    sup = Supervisor(AgentConfig(host_id="h1", model_dirs=[str(folder)], binary="llama-server", caps=CAPS,
                                 data_dir=tmp_path / "agent", dry_run=True))  # fmt: skip
    assert sup.accept_plan(old) is None
    assert sup.plan is not None and sup.plan.lanes[0] == msgspec.structs.replace(old.lanes[0], args=())  # typed only
    await sup.reconcile(now=0.0)
    assert sup.lanes[old.lanes[0].lane_id].process.argv == ["llama-server", *lane_args(old.lanes[0], CAPS)]
    await sup.stop_all()


def test_args_are_checked_by_meaning_not_bytes(folder):
    p = _plan(folder)
    spec = p.lanes[0]

    def with_args(args) -> HostPlan:
        return msgspec.structs.replace(p, lanes=(msgspec.structs.replace(spec, args=tuple(args)),))

    groups: list[list[str]] = []  # each flag with its value, if it takes one
    for tok in spec.args:
        if tok.startswith("--") or tok == "-fit":
            groups.append([tok])
        else:
            groups[-1].append(tok)
    assert len(groups) > 8 and all(len(g) <= 2 for g in groups)
    reordered = [tok for group in reversed(groups) for tok in group]
    assert reordered != list(spec.args)
    assert _check(with_args(reordered), folder) is None  # another planner's order
    louder = [tok if tok != "4" else "3" for tok in spec.args]  # --verbosity carries no lane meaning
    assert _check(with_args(louder), folder) is None
    refusals = {
        "--threads": [*spec.args, "--threads", "8"],  # a flag this agent cannot render
        "--ctx-size": [tok if tok != str(spec.ctx_total) else "999" for tok in spec.args],
        "lack --parallel": [t for i, t in enumerate(spec.args) if t != "--parallel" and spec.args[i - 1] != "--parallel"],
        "twice": [*spec.args, "--port", str(spec.port)],
        # A lane's key is the agent's alone to make: a plan naming one is refused, never launched.
        "--api-key": [*spec.args, "--api-key", "chosen-by-the-plan"],
        "--api-key-file": [*spec.args, "--api-key-file", "/etc/lanes/known.key"],
    }
    for needle, args in refusals.items():
        reason = _check(with_args(args), folder)
        assert reason is not None and needle in reason, (needle, reason)


def test_schemas_too_far_apart_are_refused(folder):
    p = _plan(folder)
    for schema in (SCHEMA_VERSION - 2, SCHEMA_VERSION + 2):
        reason = _check(msgspec.structs.replace(p, schema=schema), folder)
        assert reason is not None and f"schema {schema}" in reason
    assert _check(msgspec.structs.replace(p, schema=SCHEMA_VERSION + 1), folder) is None


def test_n_ubatch_reaches_the_command_line(folder):
    assert "--ubatch-size" not in _plan(folder).lanes[0].args  # the default: no flag, argv unchanged
    spec = _plan(folder, FleetConfig(n_ubatch=1024)).lanes[0]
    assert spec.n_ubatch == 1024
    args = list(spec.args)
    assert args[args.index("--ubatch-size") + 1] == "1024" and "--batch-size" not in args
    big = list(_plan(folder, FleetConfig(n_ubatch=4096)).lanes[0].args)
    # llama-server clamps the ubatch to the batch (2048 by default): raise both.
    assert big[big.index("--batch-size") + 1] == "4096" and big[big.index("--ubatch-size") + 1] == "4096"


def test_hugging_face_snapshot_symlinks_are_served_and_outside_paths_refused(tmp_path, tiny_models):
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    blob = repo / "blobs" / "5f1e0c9a"
    shutil.copy(tiny_models["llama8"], blob)
    os.symlink("../../blobs/5f1e0c9a", snapshot / "tiny-q4.gguf")
    for folder in (snapshot, tmp_path / "hub"):  # a snapshot folder, or the whole cache
        p = _plan(folder)
        spec = p.lanes[0]
        assert spec.model == "tiny-q4" and spec.model_path == str(snapshot / "tiny-q4.gguf")
        assert _check(p, folder) is None
    # Still refused: the resolved blob is not in the snapshot folder, nor is a path that climbs out.
    p = _plan(snapshot)
    for path in (str(blob), str(snapshot / ".." / ".." / "blobs" / "5f1e0c9a"), "/etc/passwd", "relative.gguf"):
        moved = msgspec.structs.replace(p.lanes[0], model_path=path)
        moved = msgspec.structs.replace(moved, args=lane_args(moved, CAPS))
        reason = _check(msgspec.structs.replace(p, lanes=(moved,)), snapshot)
        assert reason is not None and "outside the model folders" in reason, (path, reason)
    assert not in_model_folders(str(snapshot), [str(snapshot)])  # the folder itself is no model
