// Draws the view model the gateway pushes (gateway/dashboard/model.py); computes nothing itself.
"use strict";

const $ = (sel) => document.querySelector(sel);
const el = (tag, attrs = {}, ...children) => {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  for (const child of children) node.append(child);
  return node;
};
const gib = (n) => (n == null ? "-" : (n / 2 ** 30).toFixed(2) + " GiB");
const mib = (n) => (n == null ? "-" : (n / 2 ** 20).toFixed(1) + " MiB");
const pct = (part, whole) => (whole > 0 ? (100 * part) / whole : 0).toFixed(3) + "%";

function deviceRow(d) {
  const used = Math.max(0, d.total - d.available);  // held by other programs
  const bar = el("div", { class: "bar", title: `${d.device}: ${gib(d.total)}` });
  for (const [cls, bytes] of [["used", used], ["weights", d.weights], ["kv", d.kv], ["compute", d.compute],
                              ["prompt-cache", d.cache || 0], ["lent", d.lent || 0],
                              ["headroom", d.headroom]]) {
    bar.append(el("span", { class: cls, style: `width:${pct(bytes, d.total)}`, title: `${cls} ${gib(bytes)}` }));
  }
  if (d.real > 0) bar.append(el("span", { class: "real", style: `left:${pct(used + d.real, d.total)}`,
                                          title: `real ${gib(d.real)}` }));
  const planned = d.weights + d.kv + d.compute + (d.cache || 0) + (d.lent || 0);
  return el("div", { class: "device" }, el("span", {}, d.device), bar,
            el("span", { class: "legend" }, `planned ${gib(planned)} · real ${gib(d.real)} · free ${gib(d.free)}`));
}

function renderHosts(hosts) {
  const box = $("#hosts");
  box.replaceChildren(...hosts.map((h) => {
    const title = el("h3", {}, h.host_id,
      el("span", { class: `meta state-${h.state}` }, h.state),
      el("span", { class: "meta" }, `plan r${h.plan_revision ?? "-"} · applied r${h.applied_revision ?? "-"}`),
      el("span", { class: "meta state-failed" }, h.rollout_halted || ""));
    return el("div", { class: "host", "data-host": h.host_id }, title, ...h.devices.map(deviceRow));
  }));
  box.append(el("div", { class: "legend" }, el("i", { style: "background:var(--weights)" }), "weights",
    el("i", { style: "background:var(--kv)" }), "KV", el("i", { style: "background:var(--compute)" }), "compute",
    el("i", { style: "background:var(--prompt-cache)" }), "prompt cache",
    el("i", { style: "background:var(--lent)" }), "lent to spans",
    el("i", { style: "background:var(--headroom)" }), "headroom", el("i", { style: "background:var(--free)" }), "free",
    el("i", { style: "background:#fff" }), "real (RSS)"));
}

function threadsText(l) {
  if (l.threads == null) return "default";
  const cpus = l.cpus || [];
  if (!cpus.length) return `${l.threads}`;
  const lo = Math.min(...cpus), hi = Math.max(...cpus);
  return `${l.threads} @ ${hi - lo + 1 === cpus.length ? (lo === hi ? lo : `${lo}-${hi}`) : cpus.join(",")}`;
}

function renderLanes(hosts) {
  const rows = [];
  for (const h of hosts) for (const l of h.lanes) {
    rows.push(el("tr", { "data-lane": l.lane_id, "data-host": h.host_id },
      el("td", {}, h.host_id), el("td", {}, l.lane_id), el("td", {}, l.alias),
      el("td", { class: "window" }, `${l.ctx_per_slot} x ${l.parallel}`),
      el("td", { class: "threads" }, threadsText(l)),
      el("td", { class: "cache" }, `${l.cache_type_k}/${l.cache_type_v}`),
      el("td", { class: "fa" }, l.flash_attn),
      el("td", { class: `state state-${l.state}` }, l.state),
      el("td", {}, `${l.slots_busy} / ${l.parallel}`), el("td", { class: "rps" }, l.requests_per_second.toFixed(2)),
      el("td", { class: "kv" }, `${mib(l.kv_planned_bytes)} / ${mib(l.kv_real_bytes)}`),
      el("td", { class: "hit", title: `${l.cached_tokens} of ${l.prompt_tokens} prompt tokens cached; ` +
                 `--cache-ram ${l.cache_ram_mib ?? "default"} MiB` },
         l.cache_hit_ratio == null ? "-" : `${(100 * l.cache_hit_ratio).toFixed(0)}%`),
      el("td", { class: "error" }, l.last_error)));
  }
  $("#lanes tbody").replaceChildren(...rows);
}

function renderConfig(state) {
  $("#config-revision").textContent = `revision ${state.config_revision}`;
  const c = state.config;
  $("#config-summary").textContent =
    `config r${state.config_revision} · kv ${c.kv_cache_type_k || c.kv_cache_type || "f16"}/` +
    `${c.kv_cache_type_v || c.kv_cache_type || "f16"} · flash_attn ${c.flash_attn || "unset"}`;
  $("#config tbody").replaceChildren(...Object.entries(c).filter(([k]) => !["kind", "schema", "revision"].includes(k))
    .map(([k, v]) => el("tr", {}, el("td", {}, k), el("td", {}, v == null ? "unset" : String(v)))));
}

function renderSummary(state) {
  const s = state.summary, p = state.page;
  const states = Object.entries(s.hosts_by_state).map(([k, n]) => `${n} ${k}`).join(", ");
  $("#summary").textContent = `${s.hosts} hosts (${states || "none"}) · ${s.lanes} lanes · planned ` +
    `${gib(s.planned_bytes)} · in use ${gib(s.rss_bytes)} · ${s.lanes_with_errors} lanes with errors · ` +
    `${s.slots_busy} slots busy here`;
  $("#summary-models tbody").replaceChildren(...Object.entries(s.lanes_by_model).map(([m, byState]) =>
    el("tr", { "data-model": m }, el("td", {}, m),
       el("td", {}, Object.entries(byState).map(([k, n]) => `${n} ${k}`).join(", ")))));
  const models = $("#filter-model");
  const known = new Set([...models.options].map((o) => o.value));
  for (const m of Object.keys(s.lanes_by_model)) if (!known.has(m)) models.append(el("option", { value: m }, m));
  const last = Math.min(p.offset + p.limit, p.matched);
  $("#page-info").textContent = p.matched ? `hosts ${p.offset + 1}-${last} of ${p.matched}` +
    (p.matched !== p.total ? ` (of ${p.total})` : "") : `no host of ${p.total} matches`;
  $("#page-prev").disabled = p.offset === 0;
  $("#page-next").disabled = last >= p.matched;
}

function render(state) {
  renderSummary(state);
  renderHosts(state.hosts);
  renderLanes(state.hosts);
  renderConfig(state);
  $("#unplaced").replaceChildren(...state.unplaced.map((u) => el("li", {}, `${u.host}: ${u.model}: ${u.reason}`)));
  $("#unplaced-section").hidden = state.unplaced.length === 0;
  const waiting = (state.models || []).filter((m) => m.state !== "ready");
  $("#models").replaceChildren(...waiting.map((m) => el("li", {"class": `model-${m.state}`},
    `${m.id}: ${m.state}${m.where.length ? " on " + m.where.map((w) => w.host).join(", ") : ""}` +
    `${m.reason ? " (" + m.reason + ")" : ""}` +
    `${m.predicted_load_s != null ? `, loads in about ${m.predicted_load_s} s` : ""}` +
    `${m.measured_load_s != null ? ` (last ${m.measured_load_s} s)` : ""}`)));
  $("#models-section").hidden = waiting.length === 0;
  const tenants = state.tenants || [];
  $("#tenants").replaceChildren(...tenants.map((t) => el("li", {},
    `${t.tenant} on ${t.model}: ${t.in_flight} in flight, ${t.queued} queued`)));
  $("#tenants-section").hidden = tenants.length === 0;
  $("#events").replaceChildren(...state.events.map((e) => el("li", { class: `state-${e.event}` },
    el("time", {}, new Date(e.at * 1000).toLocaleTimeString()), `${e.host} ${e.lane} ${e.event} `,
    el("span", { class: "legend" }, e.detail || ""))));
}

// The page's filter (host, model, state, offset): the gateway sends the summary and that page
// of hosts, whole at first, then only what changed (gateway/dashboard/model.py, PageFeed).
const filter = { host: "", model: "", state: "", offset: 0 };
let state = null, source = null;

function query() {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(filter)) if (v !== "" && v !== 0) q.set(k, v);
  const text = q.toString();
  return text ? "?" + text : "";
}

function applyDelta(delta) {
  const byId = new Map(state.hosts.map((h) => [h.host_id, h]));
  for (const h of delta.hosts) byId.set(h.host_id, h);
  const { hosts, order, ...parts } = delta;
  state = { ...state, ...parts, hosts: order.map((id) => byId.get(id)).filter(Boolean) };
}

function connect() {
  if (source) source.close();
  source = new EventSource("/dashboard/api/stream" + query());
  const live = () => {
    $("#connection").textContent = "live";
    $("#connection").className = "pill on";
  };
  source.addEventListener("snapshot", (msg) => {
    live();
    state = JSON.parse(msg.data);
    render(state);
  });
  source.addEventListener("delta", (msg) => {
    live();
    if (!state) return;
    applyDelta(JSON.parse(msg.data));
    render(state);
  });
  const mine = source;
  source.onerror = async () => {
    if (mine !== source) return;  // a filter change replaced it
    $("#connection").textContent = "reconnecting";
    $("#connection").className = "pill off";
    if (source.readyState !== EventSource.CLOSED) return;  // the browser retries by itself
    // Refused (the session cookie expired): trade the tab's key again, then reconnect.
    const key = sessionStorage.getItem("lanes-api-key");
    if (key) await fetch("/dashboard/api/session", { method: "POST", headers: { Authorization: `Bearer ${key}` } });
    setTimeout(connect, 2000);
  };
}

async function applyConfig(event) {
  event.preventDefault();
  const changes = {};
  for (const pair of $("#admin-changes").value.trim().split(/\s+/).filter(Boolean)) {
    const [key, ...rest] = pair.split("=");
    const value = rest.join("=");
    changes[key] = value === "none" ? null : /^-?\d+(\.\d+)?$/.test(value) ? Number(value)
      : value === "true" ? true : value === "false" ? false : value;
  }
  const reply = await fetch("/dashboard/api/config", {
    method: "POST", body: JSON.stringify(changes),
    headers: { "Content-Type": "application/json", Authorization: `Bearer ${$("#admin-key").value}` },
  });
  const body = await reply.json();
  $("#admin-result").textContent = reply.ok ? "applied" : body.error.message;
}

function refilter() {
  filter.host = $("#filter-host").value.trim();
  filter.model = $("#filter-model").value;
  filter.state = $("#filter-state").value;
  connect();
}

fetch("/dashboard/api/state").then((r) => r.json()).then((first) => {
  $("#admin").hidden = !first.admin;
  state = first;
  render(state);
  connect();
});
$("#admin").addEventListener("submit", applyConfig);
$("#filter").addEventListener("submit", (e) => e.preventDefault());
let typing = null;
$("#filter-host").addEventListener("input", () => {
  clearTimeout(typing);
  typing = setTimeout(() => { filter.offset = 0; refilter(); }, 150);
});
for (const id of ["#filter-model", "#filter-state"]) $(id).addEventListener("change", () => { filter.offset = 0; refilter(); });
$("#page-prev").addEventListener("click", () => { filter.offset = Math.max(0, filter.offset - state.page.limit); refilter(); });
$("#page-next").addEventListener("click", () => { filter.offset += state.page.limit; refilter(); });
