"""The offline `lanes` commands, run as a subprocess the way a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from shared.gguf_facts import read_model_facts
from shared.messages.config import Demand, FleetConfig, Persona
from shared.messages.hosts import HostReport, ServerCaps
from shared.messages.plans import FleetPlan, MemoryBreakdown

ROOT = Path(__file__).resolve().parent.parent
GIB = 1024**3


def lanes(*args: str | os.PathLike[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_SERVER_BIN"}
    return subprocess.run(
        [sys.executable, "-m", "lanes.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd or ROOT,
        env=env,
    )


def assert_one_line_error(run: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert run.returncode != 0, run
    assert "Traceback" not in run.stderr and "Traceback" not in run.stdout
    lines = run.stderr.strip("\n").splitlines()
    assert len(lines) == 1, run.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def junk(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("junk") / "junk.gguf"
    path.write_bytes(b"this is not a model\n" * 50)
    return path


@pytest.fixture(scope="module")
def plan_files(tmp_path_factory, tiny_models) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("plan")
    facts = read_model_facts(tiny_models["llama8"])
    gqa = read_model_facts(tiny_models["llama_gqa"])
    reports = [
        HostReport(
            host_id="box-b", cpu_cores=4, ram_total=16 * GIB, ram_available=8 * GIB, server=ServerCaps(), models=(facts,)
        ),
        HostReport(
            host_id="box-a",
            cpu_cores=8,
            ram_total=32 * GIB,
            ram_available=20 * GIB,
            server=ServerCaps(),
            models=(facts, gqa),
        ),
    ]
    hosts = folder / "hosts.json"
    hosts.write_bytes(msgspec.json.encode(reports))
    single = folder / "single.json"
    single.write_bytes(msgspec.json.encode(reports[0]))
    config = folder / "config.json"
    config.write_bytes(msgspec.json.encode(FleetConfig(kv_cache_type="q8_0")))
    config_toml = folder / "config.toml"
    config_toml.write_text('kind = "fleet_config"\nkv_cache_type_k = "q4_0"\n')
    demand = folder / "demand.json"
    demand.write_bytes(msgspec.json.encode(Demand(personas=(Persona(model=facts.name, parallel=2, ctx_min=4096),))))
    bad_hosts = folder / "bad_hosts.json"
    bad_hosts.write_text('[{"host_id": "x", ')
    wrong_hosts = folder / "wrong_hosts.json"
    wrong_hosts.write_text('[{"kind": "host_report", "host_id": "x"}]')
    bad_config = folder / "bad_config.json"
    bad_config.write_text('{"kind": "fleet_config", "kv_cache_type": "q9_0"}')
    return {
        "hosts": hosts,
        "single": single,
        "config": config,
        "config_toml": config_toml,
        "demand": demand,
        "bad_hosts": bad_hosts,
        "wrong_hosts": wrong_hosts,
        "bad_config": bad_config,
    }


# ------------------------------------------------------------------ models


def test_models_table(tiny_models):
    run = lanes("models", tiny_models["llama8"], tiny_models["gemma3"])
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""
    out = run.stdout
    assert "llama8" in out and "gemma3" in out
    assert "32768" in out
    assert "512 (5/6)" in out  # gemma3 sliding window: 5 of 6 layers


def test_models_folder_json(tiny_models):
    folder = Path(tiny_models["llama8"]).parent
    run = lanes("models", folder, "--json")
    assert run.returncode == 0, run.stderr
    names = sorted(m["name"] for m in json.loads(run.stdout))
    assert names == ["gemma3", "llama8", "llama_gqa", "mla"]


# ------------------------------------------------------------------ estimate


def test_estimate_json_golden(tiny_models):
    run = lanes(
        "estimate", tiny_models["llama8"], "--ctx", "32768", "--cache-type-k", "q8_0", "--cache-type-v", "q8_0", "--json"
    )
    assert run.returncode == 0, run.stderr
    mem = msgspec.json.decode(run.stdout, type=MemoryBreakdown)
    assert mem.kv_bytes == 285212672  # 272.00 MiB, as llama-server prints it
    assert mem.kv_k_bytes == mem.kv_v_bytes == 142606336
    assert mem.kv_cells == 32768 and mem.kv_streams == 1


@pytest.mark.parametrize(
    ("k", "v", "kv_bytes"),
    [("f16", "f16", 512 * 2**20), ("q4_0", "q4_0", 144 * 2**20), ("q8_0", "f16", 392 * 2**20)],
)
def test_estimate_json_other_types(tiny_models, k, v, kv_bytes):
    run = lanes("estimate", tiny_models["llama8"], "--ctx", "32768", "--cache-type-k", k, "--cache-type-v", v, "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["kv_bytes"] == kv_bytes


def test_estimate_table(tiny_models):
    run = lanes("estimate", tiny_models["gemma3"], "--ctx", "4096", "--parallel", "2")
    assert run.returncode == 0, run.stderr
    assert "kv total" in run.stdout and "swa" in run.stdout


def test_estimate_takes_llama_servers_speculative_and_swa_flags(tiny_models):
    """Its figures against the binary: tests/test_speculative_real.py (a draft, its cache types and
    --spec-draft-n-max), tests/test_devices_real.py (--swa-full)."""
    model = tiny_models["gemma3"]
    plain = json.loads(lanes("estimate", model, "--ctx", "4096", "--parallel", "2", "--json").stdout)
    full = json.loads(lanes("estimate", model, "--ctx", "4096", "--parallel", "2", "--swa-full", "--json").stdout)
    assert full["swa_cells"] == full["kv_cells"] > plain["swa_cells"] and full["kv_bytes"] > plain["kv_bytes"]
    ngram = json.loads(lanes("estimate", model, "--ctx", "4096", "--parallel", "2", "--spec-type", "ngram-mod", "--json").stdout)
    assert ngram["speculator_bytes"] >= 16 * 2**20 and ngram["draft_bytes"] == 0  # ngram-mod's 16 MiB table
    drafted = lanes("estimate", model, "--ctx", "4096", "-md", tiny_models["llama8"], "-ctkd", "q8_0", "--json")
    assert drafted.returncode == 0, drafted.stderr  # a draft model alone means draft-simple, as llama-server reads it
    assert json.loads(drafted.stdout)["draft_bytes"] > 0
    table = lanes("estimate", model, "--ctx", "4096", "--spec-type", "draft-simple", "-md", tiny_models["llama8"])
    assert "of which the draft model" in table.stdout and "speculator (draft-simple)" in table.stdout
    for flags, says in ((["--spec-type", "draft-mtp"], "not predicted yet"),
                        (["--spec-type", "draft-simple"], "a draft model (--spec-draft-model) is needed"),
                        (["--spec-type", "ngram-simple", "--spec-draft-n-max", "8"], "not predicted with another length"),
                        (["--spec-type", "ngram-mod", "-md", str(tiny_models["llama8"])], "takes no draft model")):  # fmt: skip
        run = lanes("estimate", model, "--ctx", "4096", *flags)
        assert run.returncode != 0 and says in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_estimate_puts_the_draft_on_the_devices_devd_names(tiny_models):
    """-devd: the draft's buffers on the devices named (none: host RAM), the target's where they were;
    figures against the binary in tests/test_speculative_real.py (two RPC devices)."""
    model, draft = tiny_models["gemma3"], tiny_models["llama8"]
    base = [model, "--ctx", "4096", "-ngl", "all", "--gpus", "8GiB,8GiB", "--gpu-backend", "cuda", "-md", draft]

    def draft_on(*flags: str) -> dict[str, int]:
        run = lanes("estimate", *base, *flags, "--json")
        assert run.returncode == 0, run.stderr
        return {d["device"]: d["draft_bytes"] for d in json.loads(run.stdout)["devices"] if d["draft_bytes"]}

    both, second, host = draft_on(), draft_on("-devd", "CUDA1"), draft_on("--spec-draft-device", "none")
    assert {"GPU0", "GPU1"} <= set(both) and "GPU0" not in second and second["GPU1"] > both["GPU1"]
    assert set(host) == {"CPU"} and host["CPU"] > both["CPU"]
    assert draft_on("--device-draft", "CUDA1,CUDA0", "-ts", "1,0").keys() == {"CPU", "GPU1"}  # -ts by position
    for flags, says in ((["-devd", "CUDA0,CUDA0"], "a device is named twice"),
                        (["--gpus", "8GiB,8GiB,8GiB", "-devd", "CUDA0,CUDA1", "-sm", "none", "-mg", "2"],
                         "llama-server refuses the draft with --split-mode none and --main-gpu 2"),
                        (["-devd", "CUDA2"], "not one of this estimate's devices (CUDA0, CUDA1) or none")):  # fmt: skip
        assert_one_line_error(lanes("estimate", *base, *flags), says)


def test_estimate_takes_loras_as_llama_server_does_and_refuses_what_it_cannot_predict(tmp_path):
    """--lora and --lora-scaled (comma lists, repeatable): the adapters' buffers equal the binary's
    `LoRA buffer size` lines recorded in tests/lora_figures.json; an adapter llama.cpp would not
    load into the model is refused, and so is each flag the estimate cannot predict yet."""
    from record_lora_figures import FIGURES, write_case
    from tinymodels import write_llama, write_lora

    base, files = write_case(tmp_path / "case", "f16-all-embd-out-r64-v32000")
    printed = json.loads(FIGURES.read_text())["f16-all-embd-out-r64-v32000"]
    scaled = ",".join(f"{f}:0.5" for f in files)
    for flags in (["--lora", ",".join(map(str, files))], ["--lora-scaled", scaled]):
        run = lanes("estimate", base, "--ctx", "1024", *flags, "--json")
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout)["adapter_bytes"] / 2**20 == pytest.approx(printed["CPU"], abs=0.011)
    table = lanes("estimate", base, "--ctx", "1024", "--lora", files[0], "--no-warmup", "-mmdev", "none")
    assert "LoRA adapters (1)" in table.stdout, table.stderr
    wide = write_lora(tmp_path / "wide.gguf", n_embd=512)
    other = write_llama(tmp_path / "other.gguf")
    for flags, says in ((["--lora", wide], "does not fit base.gguf"), (["--lora", other], "not a LoRA adapter"),
                        (["--lora-scaled", files[0]], "give FNAME:SCALE"),
                        (["--image-max-tokens", "1024"], "--image-max-tokens: predicted for Pixtral and Qwen2-VL's "
                         "family, not yet for a lane without --mmproj"),
                        (["--image-min-tokens", "64"], "--image-min-tokens: predicted for Pixtral"),
                        (["-devd", "CUDA0"], "--spec-draft-device CUDA0: not one of this estimate's devices"),
                        (["-devd", "none"], "--spec-draft-device: places a draft model; give it with"),
                        (["-mmdev", "CUDA1"], "not one of this estimate's devices (none (no --gpus)) or none")):  # fmt: skip
        assert_one_line_error(lanes("estimate", base, "--ctx", "1024", *flags), says)


def test_estimate_plans_a_projector_at_the_image_tokens_it_is_given(tmp_path):
    """--image-max-tokens: Pixtral's buffer at the largest image it names (its build's 1,024 without it),
    host RAM holding that image as the graph's input; Qwen2-VL's family at its warm-up, a larger N refused;
    --image-min-tokens changes nothing up to the largest; types the estimate cannot size are refused."""
    from tinymodels import write_llama
    from tinyprojectors import write_projector

    from shared.gguf_projector import projector_facts
    from shared.memory.projector import host_inputs, projector_compute_bytes

    model = write_llama(tmp_path / "m.gguf", n_embd=1024)
    pixtral = write_projector(tmp_path / "mmproj-p.gguf", proj_type="pixtral", text_embd=1024, n_embd=192, n_ff=384,
                              n_head=4, n_layer=2, image_size=1024, patch_size=16, scale_factor=1)  # fmt: skip
    proj = projector_facts(pixtral)

    def estimate(*flags: str) -> dict:
        run = lanes("estimate", model, "--ctx", "1024", "--mmproj", pixtral, "--no-mmproj-offload", *flags, "--json")
        assert run.returncode == 0, run.stderr
        return json.loads(run.stdout)

    own, capped = estimate(), estimate("--image-max-tokens", "256", "--image-min-tokens", "64")
    assert own["projector_bytes"] == proj.weight_bytes + projector_compute_bytes(proj, True, 1024)
    assert own == estimate("--image-max-tokens", "1024")
    assert capped["projector_bytes"] == proj.weight_bytes + projector_compute_bytes(proj, True, 256)
    assert capped["projector_bytes"] < own["projector_bytes"] and host_inputs(proj, 256) < host_inputs(proj)
    qwen = write_projector(tmp_path / "mmproj-q.gguf", proj_type="qwen2vl_merger", text_embd=1024, n_embd=64, n_ff=128)
    gemma = write_projector(tmp_path / "mmproj-g.gguf", proj_type="gemma3", text_embd=1024)
    for path, flags, says in ((qwen, ["--image-max-tokens", "4096"], "grows its buffer past that"),
                              (pixtral, ["--image-min-tokens", "512", "--image-max-tokens", "256"], "give at most 256"),
                              (gemma, ["--image-max-tokens", "256"], "not yet for a gemma3 projector")):  # fmt: skip
        assert_one_line_error(lanes("estimate", model, "--ctx", "1024", "--mmproj", path, *flags), says)
    run = lanes("estimate", model, "--ctx", "1024", "--mmproj", qwen, "--image-max-tokens", "1024", "--json")
    assert run.returncode == 0, run.stderr  # at most the warm-up: planned at the warm-up


def test_estimate_puts_the_projector_on_the_device_mmdev_names(tmp_path):
    """-mmdev CUDA1: the projector's weights and compute on the second device, none on the first; the
    graph's input image in host RAM either way; a device the estimate does not have is refused."""
    from tinymodels import write_llama
    from tinyprojectors import write_projector

    model = write_llama(tmp_path / "m.gguf")
    proj = write_projector(tmp_path / "mmproj-g.gguf", proj_type="gemma3")
    base = ["estimate", model, "--ctx", "1024", "--mmproj", proj, "--gpus", "8GiB,8GiB", "--gpu-backend", "cuda", "--json"]

    def projector_by_device(*flags: str) -> dict:
        run = lanes(*base, *flags)
        assert run.returncode == 0, run.stderr
        return {d["device"]: d["projector_bytes"] for d in json.loads(run.stdout)["devices"]}

    first, second = projector_by_device(), projector_by_device("-mmdev", "CUDA1")
    assert first["GPU0"] == second["GPU1"] > 0 and first["GPU1"] == second["GPU0"] == 0
    assert first["CPU"] == second["CPU"] == 224 * 224 * 3 * 4  # the warm-up image, a graph input
    assert projector_by_device("--mmproj-device", "CUDA0") == first
    assert_one_line_error(lanes(*base[:-1], "-mmdev", "CUDA2"), "not one of this estimate's devices (CUDA0, CUDA1)")


# ------------------------------------------------------------------ plan


def test_plan_json_parses_as_fleet_plan(plan_files):
    run = lanes(
        "plan", "--hosts", plan_files["hosts"], "--config", plan_files["config"], "--demand", plan_files["demand"], "--json"
    )
    assert run.returncode == 0, run.stderr
    fleet = msgspec.json.decode(run.stdout, type=FleetPlan)
    assert [hp.host_id for hp in fleet.hosts] == ["box-a", "box-b"]
    lanes_ = [lane for hp in fleet.hosts for lane in hp.lanes]
    assert lanes_, fleet
    for lane in lanes_:
        assert lane.model == "llama8"
        assert lane.parallel == 2
        assert (lane.cache_type_k, lane.cache_type_v, lane.flash_attn) == ("q8_0", "q8_0", "on")
        assert lane.ctx_per_slot >= 4096
        assert "--cache-type-v" in lane.args


def test_plan_single_report_default_config(plan_files):
    run = lanes("plan", "--hosts", plan_files["single"], "--json")
    assert run.returncode == 0, run.stderr
    fleet = msgspec.json.decode(run.stdout, type=FleetPlan)
    (hp,) = fleet.hosts
    (lane,) = hp.lanes
    assert lane.cache_type_k is None and lane.flash_attn is None


def test_plan_toml_config(plan_files):
    run = lanes("plan", "--hosts", plan_files["single"], "--config", plan_files["config_toml"], "--json")
    assert run.returncode == 0, run.stderr
    (lane,) = msgspec.json.decode(run.stdout, type=FleetPlan).hosts[0].lanes
    assert (lane.cache_type_k, lane.cache_type_v) == ("q4_0", None)


def test_plan_text(plan_files):
    run = lanes("plan", "--hosts", plan_files["hosts"], "--config", plan_files["config"])
    assert run.returncode == 0, run.stderr
    assert "host box-a" in run.stdout and "llama-server --model" in run.stdout


# ------------------------------------------------------------------ bad input: one line, non-zero, no traceback


def test_error_missing_model(tmp_path):
    assert_one_line_error(lanes("estimate", tmp_path / "absent.gguf", "--ctx", "4096"), "absent.gguf", "no such file")


def test_error_models_missing(tmp_path):
    assert_one_line_error(lanes("models", tmp_path / "absent.gguf"), "absent.gguf")


def test_error_not_a_gguf(junk):
    assert_one_line_error(lanes("estimate", junk, "--ctx", "4096"), "junk.gguf", "not a GGUF")


def test_error_models_not_a_gguf(junk):
    assert_one_line_error(lanes("models", junk), "junk.gguf")


def test_error_unknown_cache_type(tiny_models):
    run = lanes("estimate", tiny_models["llama8"], "--ctx", "4096", "--cache-type-k", "q9_0")
    assert_one_line_error(run, "q9_0")


def test_error_ctx_too_small(tiny_models):
    assert_one_line_error(lanes("estimate", tiny_models["llama8"], "--ctx", "100"), "100", "256")


def test_error_ctx_not_a_number(tiny_models):
    assert_one_line_error(lanes("estimate", tiny_models["llama8"], "--ctx", "lots"), "lots")


def test_error_quantized_v_without_flash_attn(tiny_models):
    run = lanes("estimate", tiny_models["llama8"], "--ctx", "4096", "--cache-type-v", "q8_0", "--flash-attn", "off")
    assert_one_line_error(run, "q8_0", "flash")


def test_error_hosts_bad_json(plan_files):
    assert_one_line_error(lanes("plan", "--hosts", plan_files["bad_hosts"]), "bad_hosts.json")


def test_error_hosts_invalid_report(plan_files):
    assert_one_line_error(lanes("plan", "--hosts", plan_files["wrong_hosts"]), "wrong_hosts.json")


def test_error_hosts_missing(tmp_path):
    assert_one_line_error(lanes("plan", "--hosts", tmp_path / "nohosts.json"), "nohosts.json")


def test_error_bad_config(plan_files):
    run = lanes("plan", "--hosts", plan_files["single"], "--config", plan_files["bad_config"])
    assert_one_line_error(run, "bad_config.json")


def test_error_unknown_command():
    assert_one_line_error(lanes("frobnicate"))


def test_report_feeds_plan(tmp_path, tiny_models):
    """`lanes report` on a host gives the hosts file `lanes plan` dry-runs against."""
    import shutil

    from fixtures_bus import fake_binary

    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(tiny_models["llama8"], models / "llama8.gguf")
    binary = fake_binary(tmp_path / "bin")
    report = lanes("report", "--models", models, "--llama-server", binary, "--host-id", "box-1", "--max-ram", "2GiB")
    assert report.returncode == 0, report.stderr
    hosts = tmp_path / "hosts.json"
    hosts.write_text(report.stdout)
    parsed = msgspec.json.decode(report.stdout, type=HostReport)
    assert parsed.host_id == "box-1" and parsed.ram_total <= 2 * 2**30 and parsed.server.build == 11434
    assert [m.name for m in parsed.models] == ["llama8"]
    planned = lanes("plan", "--hosts", hosts, "--json")
    assert planned.returncode == 0, planned.stderr
    (host,) = msgspec.json.decode(planned.stdout, type=FleetPlan).hosts
    assert host.host_id == "box-1" and [s.lane_id for s in host.lanes] == ["llama8-0"]
    missing = lanes("report", "--models", tmp_path / "nope", "--llama-server", binary)
    assert_one_line_error(missing, "not a folder")


def test_estimate_moe_contract(tmp_path):
    """--n-cpu-moe, -ot (repeatable), --gpu-backend, --ubatch-size and --llama-build; --json keeps devices."""
    from tinymodels import write_moe

    model = write_moe(tmp_path / "moe.gguf", n_layer=4)
    base = ["estimate", model, "--ctx", "8192", "-ngl", "all", "--gpus", "8GiB", "--json"]
    full = json.loads(lanes(*base, "--gpu-backend", "rpc").stdout)
    moe = lanes(*base, "--gpu-backend", "rpc", "--n-cpu-moe", "2", "--ubatch-size", "256")
    assert moe.returncode == 0, moe.stderr
    moe = json.loads(moe.stdout)
    facts = read_model_facts(model)
    moved = sum(ew.bytes for ew in facts.expert_weights[:2])
    assert full["devices"][1]["model_bytes"] - moe["devices"][1]["model_bytes"] == moved
    assert moe["devices"][0]["model_bytes"] > full["devices"][0]["model_bytes"]
    ot = json.loads(lanes(*base, "--gpu-backend", "rpc", "-ot", r"blk\.0\.ffn_.*_exps=CPU",
                          "--override-tensor", r"blk\.1\.ffn_.*_exps=CPU", "--ubatch-size", "256").stdout)  # fmt: skip
    assert ot["devices"] == moe["devices"]
    every = json.loads(lanes(*base, "--gpu-backend", "rpc", "--cpu-moe").stdout)
    assert every["devices"] == json.loads(lanes(*base, "--gpu-backend", "rpc", "--n-cpu-moe", "4").stdout)["devices"]
    cuda = json.loads(lanes(*base, "--gpu-backend", "cuda").stdout)
    assert cuda["flash_attn"] is True and "cuda" in cuda["flash_attn_reason"]
    old = json.loads(lanes(*base, "--gpu-backend", "cuda", "--llama-build", "5000").stdout)
    assert old["flash_attn"] is False and "switch" in old["flash_attn_reason"]
    assert old["kv_streams"] == 1 and old["compute_bytes"] > cuda["compute_bytes"]
    # PR 23861 (~b9400): before it the prompt graph reserved logits for every ubatch token
    from tinymodels import write_llama

    big_vocab = write_llama(tmp_path / "vocab.gguf", n_vocab=65536)
    vocab = ["estimate", big_vocab, "--ctx", "4096", "-ngl", "all", "--gpus", "8GiB", "--gpu-backend", "cuda", "--json"]
    before, after = (json.loads(lanes(*vocab, "--llama-build", b).stdout) for b in ("9399", "9400"))
    logits_all = 65536 * 512 * 4
    assert before["devices"][1]["compute_bytes"] >= logits_all > after["devices"][1]["compute_bytes"]
    assert_one_line_error(lanes(*base, "-ot", "attn=CPU"), "not only expert tensors")
    assert_one_line_error(lanes(*base, "-ot", "exps=CUDA0"), "only overrides to CPU")
    assert_one_line_error(lanes(*base, "--n-cpu-moe", "2", "--llama-build", "6000"), "does not have it")
