"""Keys that say who and what (gateway/tenants/keys.py, lanes keys) and token-fair queueing (gateway/tenants/fairness.py)."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gateway.tenants.fairness as fairness
from gateway.tenants.quota import UsageBook
from gateway.tenants.keys import KeysFile, Tenant, digest, parse
from lanes.cli import main

EXAMPLE = f"""
# batch jobs: may be shed first
[[keys]]
sha256 = "{digest('batch-key-0001')}"
tenant = "batch-jobs"
priority = "sheddable"
models = ["*"]
tokens_per_minute = 200000
max_concurrent = 32

[[keys]]
key = "chat-key-0001"
tenant = "chat"
priority = "critical"
models = ["gemma*"]
weight = 2
"""


def test_a_keys_file_names_tenant_class_models_and_limits():
    table = parse(EXAMPLE, plain_keys=("plain-key-001",))
    batch, chat = table.find("batch-key-0001"), table.find("chat-key-0001")
    assert batch == Tenant("batch-jobs", -1, ("*",), 1.0, 200000, None, 32) and batch.klass == "sheddable"
    assert chat.klass == "critical" and chat.weight == 2.0 and chat.may_use("gemma-270m") and not chat.may_use("qwen")
    assert table.find("plain-key-001").name == "default"
    assert table.find("wrong") is None and table.find("") is None
    assert "chat-key-0001" not in repr(table)  # stored as its digest only


@pytest.mark.parametrize("text, says", [
    ("[[keys]]\ntenant = 'a'\n", "exactly one of sha256 or key"),
    ("[[keys]]\nkey = 'abcdefgh'\ntenant = 'a b'\n", "tenant must be"),
    ("[[keys]]\nkey = 'abcdefgh'\ntenant = 'a'\npriority = 'urgent'\n", "priority must be"),
    ("[[keys]]\nkey = 'abcdefgh'\ntenant = 'a'\ntokens_per_minute = 0\n", "tokens_per_minute must be"),
    ("[[keys]]\nsha256 = 'xyz'\ntenant = 'a'\n", "64 hex digits"),
    ("[[keys]]\nkey = 'abcdefgh'\ntenant = 'a'\ncolour = 1\n", "unknown field 'colour'"),
    ("[[keys]\n", "not TOML"),
])  # fmt: skip
def test_a_malformed_file_says_why_in_one_line(text, says):
    with pytest.raises(ValueError, match=says) as info:
        parse(text)
    assert "\n" not in str(info.value)


def test_the_file_is_reread_on_change_and_a_bad_one_keeps_the_last_good(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(EXAMPLE)
    keys = KeysFile(path)
    assert "2 keys, 2 tenants" in keys.check() and keys.check() is None  # unchanged: not reread
    path.write_text(EXAMPLE + "[[keys]]\nkey = 'new-key-0001'\ntenant = 'new'\n")
    assert "3 keys" in keys.check() and keys.table.find("new-key-0001").name == "new"
    path.write_text("[[keys]]\nkey = 'short'\ntenant = 'x'\n")
    said = keys.check()
    assert "at least 8 characters" in said and "keeping the last good keys" in said and keys.error
    assert keys.table.find("new-key-0001").name == "new"  # still served by the last good table
    path.unlink()
    assert "No such file" in keys.check() and keys.table.find("chat-key-0001") is not None


def test_lanes_keys_add_list_revoke(tmp_path, capsys):
    path = tmp_path / "keys.toml"
    path.write_text("# our keys\n" + EXAMPLE)
    assert main(["keys", "add", "--file", str(path), "--tenant", "team-a", "--priority", "standard",
                 "--models", "gemma,qwen", "--tokens-per-day", "1000000", "--max-concurrent", "4"]) == 0  # fmt: skip
    key = capsys.readouterr().out.strip()
    assert key.startswith("lanes-") and key not in path.read_text()  # printed once, stored as its sha256
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    found = parse(path.read_text()).find(key)
    assert found == Tenant("team-a", 0, ("gemma", "qwen"), 1.0, None, 1000000, 4)
    assert main(["keys", "list", "--file", str(path)]) == 0
    listed = capsys.readouterr().out
    assert digest(key)[:12] in listed and "team-a" in listed and "max_concurrent=4" in listed
    assert "(plain key in the file)" in listed  # chat's key = "..." is pointed out
    assert main(["keys", "revoke", "--file", str(path), digest(key)[:10]]) == 0
    text = path.read_text()
    assert parse(text).find(key) is None and parse(text).find("chat-key-0001") is not None
    assert text.startswith("# our keys\n") and "# batch jobs: may be shed first" in text  # comments kept
    assert main(["keys", "revoke", "--file", str(path), "--tenant", "chat"]) == 0
    assert parse(path.read_text()).find("chat-key-0001") is None
    assert main(["keys", "revoke", "--file", str(path), "--tenant", "chat"]) == 2  # nothing left to revoke
    # An edit that would break the file (a tenant's keys must agree) is refused, the file untouched.
    before = path.read_text()
    assert main(["keys", "add", "--file", str(path), "--tenant", "batch-jobs", "--priority", "critical"]) == 2
    assert path.read_text() == before


# ------------------------------------------------------------------ token-fair queueing (pure)


class W:
    def __init__(self, tenant: str, seq: int, priority: int = 0) -> None:
        self.tenant, self.seq, self.priority = tenant, seq, priority


def _serve(costs: dict[str, int], weights: dict[str, float], picks: int, half_life: float, dt: float = 0.01):
    """Every tenant always has a request waiting; each pick charges the tenant its request's cost."""
    ledger = fairness.Ledger(half_life=half_life, running_estimate=0)
    served = {t: 0 for t in costs}
    order, seq, now = [], 0, 0.0
    queue = []
    for t in costs:
        queue.append(W(t, seq))
        seq += 1
    for _ in range(picks):
        w = fairness.pick(queue, ledger, weights, now)
        queue.remove(w)
        ledger.charge(w.tenant, costs[w.tenant], now)
        served[w.tenant] += costs[w.tenant]
        order.append(w.tenant)
        queue.append(W(w.tenant, seq))
        seq += 1
        now += dt
    return served, order


tenants_st = st.dictionaries(st.sampled_from("abcdef"), st.integers(1, 20), min_size=2, max_size=6)


@settings(max_examples=60, deadline=None)
@given(costs=tenants_st, weights=st.lists(st.integers(1, 4), min_size=6, max_size=6), half_life=st.floats(30, 600))
def test_no_tenant_starves(costs, weights, half_life):
    w = {t: float(weights[i]) for i, t in enumerate(sorted(costs))}
    ratio = (max(costs.values()) / min(w.values())) / (min(costs.values()) / max(w.values()))
    bound = len(costs) * (int(2 * ratio) + 2)  # picks within which every waiting tenant is served
    _, order = _serve(costs, w, picks=bound * 4, half_life=half_life)
    for t in costs:
        at = [i for i, x in enumerate(order) if x == t]
        gaps = [b - a for a, b in zip([-1] + at, at + [len(order)])]
        assert at and max(gaps) <= bound, (t, max(gaps), bound)


@settings(max_examples=40, deadline=None)
@given(costs=tenants_st, half_life=st.floats(30, 600))
def test_equal_weights_converge_to_equal_shares(costs, half_life):
    served, _ = _serve(costs, {t: 1.0 for t in costs}, picks=300 * len(costs), half_life=half_life)
    assert max(served.values()) - min(served.values()) <= 2 * max(costs.values()), served


@settings(max_examples=40, deadline=None)
@given(costs=st.dictionaries(st.sampled_from("ab"), st.integers(1, 20), min_size=2, max_size=2),
       weights=st.tuples(st.integers(1, 4), st.integers(1, 4)))
def test_shares_follow_weights(costs, weights):
    w = {"a": float(weights[0]), "b": float(weights[1])}
    served, _ = _serve(costs, w, picks=600, half_life=0)  # no decay: the whole run's shares
    per_weight = {t: served[t] / w[t] for t in served}
    assert abs(per_weight["a"] - per_weight["b"]) <= 2 * max(costs.values()), (served, w)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 30), spent=st.floats(0, 1e6), others=st.floats(0, 10))
def test_a_tenant_alone_gets_everything_in_order(n, spent, others):
    ledger = fairness.Ledger()
    ledger.charge("heavy", spent, 0.0)
    ledger.charge("idle", others, 0.0)  # a cheaper tenant with nothing waiting takes nothing
    queue = [W("heavy", i) for i in range(n)]
    got = []
    while queue:
        w = fairness.pick(queue, ledger, {}, 1.0)
        queue.remove(w)
        got.append(w.seq)
    assert got == list(range(n))


def test_priority_comes_before_cost_and_cost_before_arrival():
    ledger = fairness.Ledger(running_estimate=0)
    ledger.charge("busy", 10_000, 0.0)
    queue = [W("cheap", 0, priority=-1), W("busy", 1), W("other", 2), W("busy", 3, priority=1)]
    assert [(w.tenant, w.seq) for w in fairness.order(queue, ledger, {}, 0.0)] == [
        ("busy", 3), ("other", 2), ("busy", 1), ("cheap", 0)]  # fmt: skip


def test_running_requests_count_until_their_answer_is_charged():
    ledger = fairness.Ledger(half_life=60, running_estimate=100)
    ledger.started("a")
    ledger.started("a")
    assert ledger.cost("a", 0) == 200 and ledger.cost("b", 0) == 0
    ledger.finished("a")
    ledger.charge("a", ledger.tokens(50, 25), 0)  # output weighted 2x: 100 tokens
    assert ledger.cost("a", 0) == 100 + 100
    assert ledger.cost("a", 60) == pytest.approx(50 + 100)  # half after one half-life; the running one whole


# ------------------------------------------------------------------ token limits, summed over gateways (pure)


def test_token_limits_count_every_gateway_and_name_the_limit():
    wall = 1_800_000_000.0  # a minute starts at a multiple of 60
    team = Tenant("team", tokens_per_minute=1000, tokens_per_day=5000)
    one, two = UsageBook("gw1"), UsageBook("gw2")
    one.add("team", 600, wall)
    assert one.check(team, wall) is None
    for u in one.take_dirty():
        two.merge(u)
    two.add("team", 400, wall + 1)
    refused = two.check(team, wall + 1)
    assert refused.status == 429 and refused.code == "tokens_per_minute" and "1000" in str(refused)
    assert refused.retry_after == 60  # seconds to the next minute
    assert two.check(team, wall + 61) is None  # a new minute
    two.add("team", 4000, wall + 62)
    refused = two.check(team, wall + 62)
    assert refused.code == "tokens_per_day" and refused.retry_after > 3600


def test_an_answers_output_tokens_are_read_for_its_tenants_cost():
    from gateway.tenants.usage import output_tokens

    assert output_tokens(b'{"timings": {"prompt_n": 10, "cache_n": 5, "predicted_n": 7}}', False) == 7
    assert output_tokens(b'{"usage": {"prompt_tokens": 4, "completion_tokens": 9}}', False) == 9
    stream = b'data: {"choices": []}\n\ndata: {"choices": [], "timings": {"prompt_n": 3, "predicted_n": 2}}\n\n'
    assert output_tokens(stream, True) == 2
    assert output_tokens(b"not json", False) == 0 and output_tokens(b"data: [DONE]\n", True) == 0


# ------------------------------------------------------------------ admission: classes and tenants (pure)


async def test_critical_waits_past_the_others_limit_and_tenant_counts_come_back_to_zero():
    import asyncio

    from gateway.admission.queue import Admission
    from gateway.refusals import QueueTimeout
    from test_gateway_core import fleet

    adm = Admission(fleet(("h1", 8080)), max_queue=4, max_wait=0.05, critical_wait=60)
    held = [await adm.acquire("gemma"), await adm.acquire("gemma")]
    ops = Tenant("ops", priority=1)
    critical = asyncio.create_task(adm.acquire("gemma", who=ops))
    with pytest.raises(QueueTimeout):  # a standard request gives up after max_wait ...
        await adm.acquire("gemma", who=Tenant("team"))
    assert not critical.done() and adm.counts.tenant_queued == {("gemma", "ops"): 1}  # ... critical still waits
    held[0].release()
    lease = await critical
    assert adm.counts.tenant_in_flight == {("gemma", "anonymous"): 1, ("gemma", "ops"): 1}
    assert adm.counts.tenant_load("ops") == 1
    lease.release()
    held[1].release()
    assert adm.counts.tenant_in_flight == {} and adm.counts.tenant_queued == {} and adm.counts.tenant_load("ops") == 0


def test_lanes_keys_add_gives_a_role_and_list_shows_it(tmp_path, capsys):
    path = tmp_path / "keys.toml"
    assert main(["keys", "add", "--file", str(path), "--tenant", "sre", "--role", "ops"]) == 0
    key = capsys.readouterr().out.strip()
    assert parse(path.read_text()).role(digest(key)) == "ops"
    assert main(["keys", "add", "--file", str(path), "--tenant", "team"]) == 0
    plain = capsys.readouterr().out.strip()
    assert parse(path.read_text()).role(digest(plain)) == "tenant" and "role" not in path.read_text().split("team")[1]
    assert main(["keys", "list", "--file", str(path)]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert any("sre" in line and "role=ops" in line for line in listed)
    assert not any("team" in line and "role=" in line for line in listed)


def test_a_request_naming_the_model_never_reaches_another_tenants_dedicated_lanes(tmp_path):
    """Lanes of alias chat-acme (model m) are acme's: beta naming the model "m" routes among the
    shared ones only, acme naming it may use its own, and naming an alias leaves nothing out."""
    from aiohttp import web

    from gateway.edge.app_keys import KEYS, VIEW
    from gateway.edge.tenancy import foreign_lanes
    from gateway.fleet.view import FleetView
    from test_gateway_core import healthy, put_plan, put_status, spec

    path = tmp_path / "keys.toml"
    path.write_text('[[keys]]\nkey = "sk-acme-0001"\ntenant = "acme"\ncache = "private"\nlanes = { chat = "chat-acme" }\n'
                    '[[keys]]\nkey = "sk-beta-0001"\ntenant = "beta"\n')  # fmt: skip
    keys = KeysFile(path)
    keys.check()
    view = FleetView()
    put_plan(view, "h", spec("chat-0", model="m", alias="chat", port=1), spec("acme-0", model="m", alias="chat-acme", port=2))
    put_status(view, "h", healthy("chat-0", 1), healthy("acme-0", 2))
    app = web.Application()
    app[KEYS], app[VIEW] = keys, view
    acme, beta = keys.table.find("sk-acme-0001"), keys.table.find("sk-beta-0001")
    assert foreign_lanes(app, beta, "m") == {("h", "acme-0")}
    assert foreign_lanes(app, acme, "m") == frozenset()
    assert foreign_lanes(app, beta, "chat") == foreign_lanes(app, acme, "chat-acme") == frozenset()


def test_a_private_cache_names_the_lanes_dedicated_to_its_tenant():
    from gateway.tenants.keys import parse

    table = parse('[[keys]]\nkey = "sk-acme-0001"\ntenant = "acme"\ncache = "private"\nlanes = { chat = "chat-acme" }\n'
                  '[[keys]]\nkey = "sk-beta-0001"\ntenant = "beta"\n')  # fmt: skip
    acme, beta = table.find("sk-acme-0001"), table.find("sk-beta-0001")
    assert acme.cache == "private" and acme.dedicated("chat") == "chat-acme" and acme.dedicated("other") is None
    assert beta.cache == "shared" and beta.lanes == ()
    assert table.dedicated_to == {"chat-acme": "acme"}
    for text, needle in (
        ('cache = "secret"', "cache must be one of shared, private"),
        ('lanes = ["chat-acme"]', "lanes must map a model name"),
        ('lanes = { chat = "chat-acme:adapter" }', "lanes must map a model name"),
    ):
        with pytest.raises(ValueError, match=needle):
            parse(f'[[keys]]\nkey = "sk-acme-0001"\ntenant = "acme"\n{text}\n')
    with pytest.raises(ValueError, match="dedicated to two tenants"):
        parse('[[keys]]\nkey = "sk-acme-0001"\ntenant = "acme"\nlanes = { chat = "mine" }\n'
              '[[keys]]\nkey = "sk-beta-0001"\ntenant = "beta"\nlanes = { chat = "mine" }\n')  # fmt: skip
