"""The planner pauses the cyclic garbage collector while it plans (planner_svc/gc_pause.py)."""

from __future__ import annotations

import gc
import threading

import pytest

from planner_svc import planner
from planner_svc.gc_pause import gc_paused
from shared.messages.config import FleetConfig
from test_planner import host


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_paused_during_the_call_and_on_again_after(collector_on):
    seen = []
    gc_paused(lambda: seen.append(gc.isenabled()))()
    assert seen == [False] and gc.isenabled()


def test_on_again_after_an_exception(collector_on):
    def boom():
        raise ValueError("x")

    with pytest.raises(ValueError):
        gc_paused(boom)()
    assert gc.isenabled()


def test_left_off_when_it_was_off_before(collector_on):
    gc.disable()
    gc_paused(lambda: None)()
    assert not gc.isenabled()


def test_overlapping_calls_keep_it_paused_until_the_last_returns(collector_on):
    inside, release, seen = threading.Event(), threading.Event(), []

    def long_call():
        inside.set()
        release.wait(30)

    other = threading.Thread(target=gc_paused(long_call))
    other.start()
    assert inside.wait(30)
    gc_paused(lambda: None)()  # a second call returns first: the collector stays paused
    seen.append(gc.isenabled())
    release.set()
    other.join(30)
    assert seen == [False] and gc.isenabled()


def test_plan_runs_with_the_collector_paused(collector_on, monkeypatch):
    seen = []
    real = planner._host_plan

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "_host_plan", spy)
    fleet = planner.plan([host()], FleetConfig())
    assert fleet.hosts[0].lanes and seen == [False] and gc.isenabled()
