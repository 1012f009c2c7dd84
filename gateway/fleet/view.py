"""The gateway's view of the fleet: lanes from plans and status, as the bus tells them.

Pure: no sockets, no clock. The bus adapter feeds it KV entries (`apply_entry`), and the
health prober and failed requests mark lanes the gateway cannot reach. It holds facts
only: the load (requests in flight, queues) is the admission's (gateway/admission/queue.py).
The dashboard reads the same object, so what it shows is what routes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from shared import subjects
from shared.lane_secrets import fingerprint
from shared.llama.endpoints import WILDCARD_BINDS
from shared.messages.activity import ModelState, ModelStates
from shared.messages.config import FleetConfig
from shared.messages.hosts import HostReport
from shared.messages.plans import HostPlan
from shared.messages.replies import FleetHosts
from shared.messages.status import HostStatus, LaneSecret

LaneKey = tuple[str, str]  # (host_id, lane_id)


@dataclass(frozen=True, slots=True)
class LaneRoute:
    """One lane as the gateway routes to it."""

    host_id: str
    lane_id: str
    model: str
    alias: str
    url: str  # http://address:port, no trailing slash
    parallel: int
    state: str  # the agent's state for it ("pending" until the agent reports it)
    draining: bool = False
    unreachable: str = ""  # why the gateway's own probe or a request could not reach it
    window: int = 0  # tokens per slot (the plan's ctx_per_slot); 0 where the plan does not say
    embeddings: bool = False  # started with --embeddings: it serves /v1/embeddings only
    adapters: tuple[str, ...] = ()  # its LoRA adapters (--lora order): it serves "alias:adapter" too
    reranking: bool = False  # started with --reranking: it serves /v1/rerank
    vision: bool = False  # started with --mmproj (a projector that reads images)
    image_max_aspect: int = 0  # the longest image (long side over short) its plan holds; 0: any
    cache_tokens: int = 0  # prompt tokens it keeps: its slots' windows and its --cache-ram; 0 not known
    # The key the lane answers to (its agent's, bucket lanes-secrets); "": none known (a lane of an
    # agent from before lane keys). Never shown: not in repr, not in the dashboard's state.
    api_key: str = field(default="", repr=False, compare=False)
    key_id: str = ""  # the fingerprint of the key its agent says it answers: routed only once that key is here

    @property
    def auth(self) -> dict[str, str]:
        """The headers that open the lane to this gateway."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def adapter_id(self, adapter: str) -> int | None:
        """The adapter's id in this lane's --lora list (a request's `lora` ids), or None."""
        return self.adapters.index(adapter) if adapter in self.adapters else None

    @property
    def key(self) -> LaneKey:
        return (self.host_id, self.lane_id)

    @property
    def routable(self) -> bool:
        keyed = not self.key_id or (bool(self.api_key) and fingerprint(self.api_key) == self.key_id)
        return self.state == "healthy" and not self.draining and not self.unreachable and keyed

    def serves(self, name: str) -> bool:
        base, _, adapter = name.partition(":")
        return base in (self.alias, self.model) and (not adapter or adapter in self.adapters)


def lane_address(status: HostStatus | None, bind: str, host_id: str) -> str:
    """Where a lane is reached: the agent's advertised address, its bind, or the host's name."""
    if status is not None and status.address:
        return status.address
    if bind not in WILDCARD_BINDS:
        return bind
    return host_id


def kept_tokens(spec) -> int:
    """Prompt tokens llama-server keeps for a lane: each slot's last prompt (its window) and what
    its host-RAM prompt cache (--cache-ram MiB; None: the binary's 8192) holds at the KV bytes a
    token takes (the plan's KV over its cells). 0 where the plan does not say."""
    slots = spec.ctx_total  # every slot's cells, shared (--kv-unified) or not
    memory = spec.memory
    per_token = memory.kv_bytes / memory.kv_cells if memory.kv_cells > 0 and memory.kv_bytes > 0 else 0.0
    ram = 8192 if spec.cache_ram_mib is None else spec.cache_ram_mib
    cached = int(ram * 2**20 / per_token) if per_token > 0 else 0
    return slots + cached


def _url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"


@dataclass
class FleetView:
    """Everything the gateway knows of the fleet; one per gateway process."""

    plans: dict[str, HostPlan] = field(default_factory=dict)
    statuses: dict[str, HostStatus] = field(default_factory=dict)
    reports: dict[str, HostReport] = field(default_factory=dict)
    config: FleetConfig | None = None
    unreachable: dict[LaneKey, str] = field(default_factory=dict)
    secrets: dict[LaneKey, str] = field(default_factory=dict, repr=False)  # each lane's key, by (host token, lane)
    # Lanes whose inference loop seems stuck (no first token in time, /slots unanswered): out of
    # rotation until their /slots answers again; their /health answering does not bring them back.
    stalled: dict[LaneKey, str] = field(default_factory=dict)
    host_states: dict[str, str] = field(default_factory=dict)  # host token -> "live" | "lost", from the planner
    # Every servable model and its load state, from the planner (KV key `models`); None: not yet written.
    catalogue: ModelStates | None = None
    synced: bool = False  # the first full snapshot of the bucket has been read
    bad_entries: int = 0
    # Told of every change, with the host token it concerns (None: anything, or the whole fleet).
    listeners: list[Callable[[str | None], None]] = field(default_factory=list)
    # The lanes, built per host (a status of one host rebuilds that host's only: at 10,000 hosts a
    # whole rebuild took 0.24 s), by name, and whole, each rebuilt when asked after a change.
    _hosts: dict[str, list[LaneRoute]] = field(default_factory=dict)  # host token -> its lanes
    _by_base: dict[str, dict[str, list[LaneRoute]]] = field(default_factory=dict)  # alias or model -> host -> lanes
    _named: dict[str, list[LaneRoute]] = field(default_factory=dict)  # requested name -> the lanes serving it
    _routable: dict[str, list[LaneRoute]] = field(default_factory=dict)  # ... those of them routable
    _dirty: set[str] = field(default_factory=set)  # hosts to rebuild
    _all_dirty: bool = True
    _lanes: list[LaneRoute] | None = None
    _probe_groups: tuple[list[LaneRoute], list[LaneRoute], list[LaneRoute]] | None = None  # (of lanes(), down, up)
    _read: asyncio.Event | None = None  # set with `synced` (made on the loop, once something waits)

    def mark_synced(self) -> None:
        self.synced = True
        if self._read is not None:
            self._read.set()

    async def wait_synced(self, timeout: float) -> bool:
        """Until the first snapshot is read, at most `timeout` seconds: whether it was. A request
        that came before would be told its model is not served (404) when the fleet is merely
        not read yet (a gateway just started, or the planner not up: it waits for the bucket)."""
        if self.synced:
            return True
        if self._read is None:
            self._read = asyncio.Event()
        try:
            await asyncio.wait_for(self._read.wait(), timeout)
        except TimeoutError:
            pass
        return self.synced

    # ------------------------------------------------------------ input

    def apply_entry(self, key: str, value: bytes | None) -> str | None:
        """Fold one KV entry in; returns why it was dropped, or None."""
        kind, _, host = key.partition(".")
        tables = {"plan": (self.plans, HostPlan), "status": (self.statuses, HostStatus),
                  "report": (self.reports, HostReport)}  # fmt: skip
        try:
            if key == subjects.MODELS_KEY:
                self.catalogue = None if value is None else msgspec.json.decode(value, type=ModelStates)
                self.changed()
                return None
            if key == subjects.HOSTS_KEY:
                hosts = FleetHosts() if value is None else msgspec.json.decode(value, type=FleetHosts)
                self.host_states = {subjects.host_token(h.host_id): h.state for h in hosts.hosts}
                self.changed()
                return None
            if key == subjects.CONFIG_KEY:
                if value is not None:
                    self.config = msgspec.json.decode(value, type=FleetConfig)
            elif kind in tables and host:
                table, type_ = tables[kind]
                if value is None:
                    table.pop(host, None)
                else:
                    msg = msgspec.json.decode(value, type=type_)
                    if subjects.host_token(msg.host_id) != host:
                        raise ValueError(f"{kind} for {msg.host_id!r} under key {key!r}")
                    if kind == "status":
                        self._new_processes(table.get(host), msg)
                        # Lanes' argv and stderr and the planner's feedback are for `lanes status`;
                        # the gateway neither routes nor draws with them.
                        msg = msgspec.structs.replace(msg, feedback=(), lanes=tuple(
                            msgspec.structs.replace(lane, argv=(), stderr_tail=()) for lane in msg.lanes))
                    elif kind == "report":
                        # Its memory and devices are what a gateway shows (the dashboard's bars); the
                        # model facts were most of a 10,000-host view's memory (bench/gateway_idle.py).
                        msg = msgspec.structs.replace(msg, models=(), adapters=())
                    elif kind == "plan":  # the planner's reasons are for `lanes explain`, not for routing
                        msg = msgspec.structs.replace(msg, reasons=(), lanes=tuple(
                            msgspec.structs.replace(spec, reasons=()) for spec in msg.lanes))
                    table[host] = msg
            else:
                return None  # demand and keys the gateway does not use
        except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
            self.bad_entries += 1
            return f"{key}: {exc}"
        if kind in ("plan", "status", "report"):  # the dashboard shows them all
            self.changed(host)
        elif key == subjects.CONFIG_KEY:
            self.changed()
        return None

    def apply_secret(self, key: str, value: bytes | None) -> str | None:
        """Fold one entry of bucket lanes-secrets in; returns why it was dropped, or None."""
        kind, _, rest = key.partition(".")
        host, _, lane = rest.partition(".")
        if kind != "lane" or not host or not lane:
            return f"{key}: not a lane's key"
        if value is None:
            self.secrets.pop((host, lane), None)
        else:
            try:
                secret = msgspec.json.decode(value, type=LaneSecret)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                self.bad_entries += 1
                return f"{key}: {exc}"
            if (subjects.host_token(secret.host_id), subjects.host_token(secret.lane_id)) != (host, lane):
                self.bad_entries += 1
                return f"{key}: a key for {secret.host_id}/{secret.lane_id}"
            self.secrets[(host, lane)] = secret.key
        self.changed(host)  # a lane whose key has come is routable now
        return None

    def _new_processes(self, before: HostStatus | None, now: HostStatus) -> None:
        """A lane its agent reports newly healthy in a new process (a restart: another pid) is no longer
        what this gateway found unreachable or stalled: those verdicts were of the process that
        stopped (a probe refused while it restarted). Kept, they held the lane out of rotation
        until the next probe, while the rollout, seeing it healthy, drained the next lane: two
        lanes of three out at once (test_rollout_live). A lane really cut off is found so again
        by its next probe or request."""
        old = {lane.lane_id: (lane.pid, lane.state) for lane in before.lanes} if before is not None else {}
        for lane in now.lanes:
            if lane.state == "healthy" and lane.pid is not None and old.get(lane.lane_id) != (lane.pid, "healthy"):
                key = (now.host_id, lane.lane_id)
                self.unreachable.pop(key, None)
                self.stalled.pop(key, None)

    def mark_unreachable(self, key: LaneKey, reason: str) -> None:
        if self.unreachable.get(key) != reason:
            self.unreachable[key] = reason
            self.changed(subjects.host_token(key[0]))

    def mark_reachable(self, key: LaneKey) -> None:
        if self.unreachable.pop(key, None) is not None:
            self.changed(subjects.host_token(key[0]))

    def mark_stalled(self, key: LaneKey, reason: str) -> None:
        if self.stalled.get(key) != reason:
            self.stalled[key] = reason
            self.changed(subjects.host_token(key[0]))

    def mark_progressing(self, key: LaneKey) -> None:
        """Its /slots answered: the inference loop runs."""
        if self.stalled.pop(key, None) is not None:
            self.changed(subjects.host_token(key[0]))

    def changed(self, host: str | None = None) -> None:
        """Something of `host` (a host token; None: anything) changed: its lanes are built again when asked."""
        if host is None:
            self._all_dirty = True
        else:
            self._dirty.add(host)
        self._lanes = None
        for listener in self.listeners:
            listener(host)

    # ------------------------------------------------------------ lanes

    def lanes(self) -> list[LaneRoute]:
        """Every planned lane, with what its agent last said of it, host by host in host order."""
        self._refresh()
        if self._lanes is None:
            self._lanes = [lane for host in sorted(self._hosts) for lane in self._hosts[host]]
        return self._lanes

    def host_lanes(self, host: str) -> list[LaneRoute]:
        """The lanes of one host (its token)."""
        self._refresh()
        return self._hosts.get(host, [])

    def lane(self, key: LaneKey) -> LaneRoute | None:
        """One lane by its key, without a walk of the fleet."""
        return next((lane for lane in self.host_lanes(subjects.host_token(key[0])) if lane.lane_id == key[1]), None)

    def _refresh(self) -> None:
        if self._all_dirty:
            self._all_dirty, self._dirty = False, set()
            self._hosts, self._by_base, self._named, self._routable = {}, {}, {}, {}
            for host in sorted(self.plans):
                self._put_host(host, list(self._build_host(host)))
            return
        for host in self._dirty:
            old = self._hosts.get(host, [])
            new = list(self._build_host(host)) if host in self.plans else []
            bases = {base for lane in (*old, *new) for base in (lane.alias, lane.model)}
            for base in bases - {b for lane in new for b in (lane.alias, lane.model)}:
                self._by_base.get(base, {}).pop(host, None)
            for name in [n for n in self._named if n.partition(":")[0] in bases]:
                del self._named[name]
                self._routable.pop(name, None)
            if new:
                self._put_host(host, new)
            else:
                self._hosts.pop(host, None)
        self._dirty = set()

    def _put_host(self, host: str, lanes: list[LaneRoute]) -> None:
        self._hosts[host] = lanes
        for base in {b for lane in lanes for b in (lane.alias, lane.model)}:
            self._by_base.setdefault(base, {})[host] = [lane for lane in lanes if base in (lane.alias, lane.model)]

    def _build_host(self, host: str):
        plan = self.plans.get(host)
        if plan is not None:
            status = self.statuses.get(host)
            running = {lane.lane_id: lane for lane in status.lanes} if status else {}
            for spec in plan.lanes:
                live = running.get(spec.lane_id)
                # The lane that runs may still be the previous plan's: it serves where it listens.
                port = live.port if live and live.port else spec.port
                key = (plan.host_id, spec.lane_id)
                yield LaneRoute(
                    host_id=plan.host_id,
                    lane_id=spec.lane_id,
                    model=spec.model,
                    alias=spec.alias,
                    url=_url(lane_address(status, spec.bind, plan.host_id), port),
                    parallel=spec.parallel,
                    state=live.state if live else "pending",
                    draining=live.draining if live else False,
                    unreachable=self.unreachable.get(key, "") or self.stalled.get(key, ""),
                    window=spec.ctx_per_slot,
                    embeddings=spec.embeddings,
                    adapters=spec.adapters,
                    reranking=spec.reranking,
                    vision=spec.mmproj_path is not None,
                    image_max_aspect=spec.image_max_aspect or 0,
                    cache_tokens=kept_tokens(spec),
                    api_key=self.secrets.get((host, subjects.host_token(spec.lane_id)), ""),
                    key_id=live.key_id if live else "",
                )

    def model_entry(self, name: str) -> ModelState | None:
        """The planner's entry for a requested name: a persona's name first, else a model's."""
        entries = self.catalogue.models if self.catalogue else ()
        name, _, adapter = name.partition(":")
        found = next((m for m in entries if m.name == name), None) or next((m for m in entries if m.model == name), None)
        return found if found is not None and (not adapter or adapter in found.adapters) else None

    def lanes_for(self, name: str) -> list[LaneRoute]:
        """The lanes serving a requested name (kept until a host of theirs changes; a name nothing
        serves is not kept, so clients' made-up names cannot grow it)."""
        self._refresh()
        found = self._named.get(name)
        if found is None:
            hosts = self._by_base.get(name.partition(":")[0], {})
            found = [lane for lanes in hosts.values() for lane in lanes if lane.serves(name)]
            if found:
                self._named[name] = found
        return found

    def routable(self, name: str) -> list[LaneRoute]:
        found = self._routable.get(name)
        if found is None or self._dirty or self._all_dirty:
            found = [lane for lane in self.lanes_for(name) if lane.routable]
            if name in self._named:  # kept as long as the lanes it was cut from
                self._routable[name] = found
        return found

    def probe_targets(self) -> list[LaneRoute]:
        """Lanes the agent calls healthy: the gateway checks it can reach them itself."""
        down, up = self.probe_groups()
        return [*down, *up]

    def probe_groups(self) -> tuple[list[LaneRoute], list[LaneRoute]]:
        """The probe's targets, those out of rotation and the others; kept until the next change
        (a round once a second walked 30,000 lanes of a 10,000-host fleet for its 64)."""
        lanes = self.lanes()
        if self._probe_groups is None or self._probe_groups[0] is not lanes:
            healthy = [lane for lane in lanes if lane.state == "healthy"]
            self._probe_groups = (lanes, [lane for lane in healthy if lane.unreachable],
                                  [lane for lane in healthy if not lane.unreachable])  # fmt: skip
        return self._probe_groups[1], self._probe_groups[2]
