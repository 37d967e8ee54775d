"""The finished bell (``app.devices.bell``): a counter two mappings of one /dev/shm file share,
and the engine's watch over it (when to ask the sidecar), on a fake clock."""

from __future__ import annotations

import os

import pytest

from app.devices.bell import Bell, BellWatch
from app.devices.shm import SHM_DIR
from app.errors import ConfigError
from tests.conftest import Clock


def test_a_ring_on_one_mapping_is_read_on_the_other() -> None:
    engine = Bell.create("kvs-test")
    sidecar = Bell.open(engine.name)
    try:
        engine.unlink()  # both mappings outlive the name
        assert not os.path.exists(os.path.join(SHM_DIR, engine.name))
        before = engine.read()
        sidecar.ring()
        sidecar.ring()
        assert engine.read() == before + 2
    finally:
        sidecar.close()
        engine.close()


def test_a_missing_bell_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        Bell.open("kvs-test-bell-never-made")


def test_the_watch_asks_when_rung_or_after_the_safety_interval() -> None:
    bell, clock = Bell.create("kvs-test"), Clock(100.0)
    bell.unlink()
    watch = BellWatch(bell, safety_s=1.0, clock=clock)
    try:
        assert watch.due()  # never asked: ask
        watch.asking()
        clock.now += 0.5
        assert not watch.due()  # nothing rang
        bell.ring()
        assert watch.due()
        watch.asking()
        assert not watch.due()
        clock.now += 1.0
        assert watch.due()  # nothing rang, but a second passed: ask anyway
    finally:
        bell.close()


def test_a_ring_during_a_round_trip_is_seen_by_the_next_check() -> None:
    bell, clock = Bell.create("kvs-test"), Clock(100.0)
    bell.unlink()
    watch = BellWatch(bell, clock=clock)
    try:
        watch.asking()  # the value is read before the call goes out...
        bell.ring()  # ...so a request that ends while the sidecar answers is not missed
        assert watch.due()
    finally:
        bell.close()


def test_without_a_bell_every_check_asks() -> None:
    watch = BellWatch(None, clock=Clock(100.0))
    watch.asking()
    assert watch.due()


def test_a_closed_bell_ignores_late_rings() -> None:
    """The sidecar closes a replaced registration's bell (its mapping of the dead engine's
    file goes with it); requests of that registration that end later ring nothing."""
    engine = Bell.create("kvs-test")
    sidecar = Bell.open(engine.name)
    engine.unlink()
    try:
        before = engine.read()
        sidecar.close()
        sidecar.ring()
        sidecar.close()  # twice is fine
        assert engine.read() == before
    finally:
        engine.close()
