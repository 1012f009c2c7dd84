"""Reading the bucket on a 3-node nats-server cluster, as the compose deploy runs it: a watch's
caught-up marker can come before the entries there (shared/bus.py, watch_was_empty)."""

from __future__ import annotations

import asyncio

import nats
import pytest
from fixtures_bus import start_nats_cluster
from nats.js.api import KeyValueConfig, StorageType

from shared.bus import read_all, watch_forever

KEYS = 300
WATCHES_PER_NODE = 10  # nats-py's marker came early in 15 of 90 watches here: 30 watches miss it 1 time in 240


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    nodes = start_nats_cluster(tmp_path_factory.mktemp("cluster"))
    yield nodes
    for node in nodes:
        node.stop()


async def _bucket(nc, name: str):
    """A 3-replica bucket, made once the cluster has elected its JetStream leader."""
    js = nc.jetstream()
    for _ in range(120):
        try:
            return await js.create_key_value(KeyValueConfig(bucket=name, replicas=3, storage=StorageType.FILE))
        except Exception:  # no JetStream meta leader yet
            await asyncio.sleep(0.5)
    raise AssertionError(f"bucket {name} not made in 60 s")


async def _filled(nc, name: str) -> None:
    kv = await _bucket(nc, name)
    for i in range(0, KEYS, 50):
        await asyncio.gather(*(kv.put(f"k.{j}", f"value {j}".encode()) for j in range(i, i + 50)))
    await kv.put("k.0", b"value 0, again")
    await kv.delete("k.1")


async def _caught_up_after(kv) -> int:
    """How many keys watch_forever had given when it called on_caught_up."""
    seen: dict[str, bytes | None] = {}
    stop, resync = asyncio.Event(), asyncio.Event()
    counted: list[int] = []

    async def on_entry(key: str, value: bytes | None, revision: int) -> None:
        seen[key] = value

    async def on_caught_up() -> None:
        counted.append(len(seen))
        stop.set()

    await asyncio.wait_for(watch_forever(kv, ">", on_entry, resync=resync, stop=stop, on_caught_up=on_caught_up), 30)
    assert len(counted) == 1, counted
    return counted[0]


async def test_a_watch_is_caught_up_only_after_every_key_on_every_node(cluster):
    setup = await nats.connect(cluster[0].url)
    try:
        await _filled(setup, "full")
    finally:
        await setup.close()
    for node in cluster:
        nc = await nats.connect(node.url)
        try:
            kv = await nc.jetstream().key_value("full")
            for _ in range(WATCHES_PER_NODE):
                assert await _caught_up_after(kv) == KEYS  # k.1 comes as a delete, counted as a key
                values = await read_all(kv)
                assert len(values) == KEYS - 1 and "k.1" not in values and values["k.0"] == b"value 0, again"
                assert values["k.299"] == b"value 299"
        finally:
            await nc.close()


async def test_an_empty_bucket_is_caught_up_at_once(cluster):
    nc = await nats.connect(cluster[1].url)
    try:
        kv = await _bucket(nc, "empty")
        assert await _caught_up_after(kv) == 0
        assert await read_all(kv) == {}
    finally:
        await nc.close()
