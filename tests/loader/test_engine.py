"""The read engine's configuration and ownership: explicit fields win over the
environment, which fills only what is left ``None``; bad values are one-line errors;
engines of one process that ask for the same decoders share them, each reader gives
its lease back on close, and idle decoders stop."""

from __future__ import annotations

import pytest

from loader.engine import Engine, EngineConfig
from loader.engine.engine import running, stop_idle
from loader.errors import InputError


@pytest.mark.parametrize(
    ("config", "environ", "expected"),
    [
        (EngineConfig(cores=4, workers=0), {}, (4, 4, "processes", 0)),
        (EngineConfig(cores=1, workers=0), {}, (1, 1, "threads", 0)),
        (EngineConfig(cores=5, workers=2), {}, (5, 2, "threads", 2)),
        (EngineConfig(workers=0), {"SCLAYOUT_CORES": "3"}, (3, 3, "processes", 0)),
        (EngineConfig(cores=8, workers=0), {"SCLAYOUT_DECODE": "Threads"}, (8, 8, "threads", 0)),
        (
            EngineConfig(cores=4, threads=2, workers=0),
            {"SCLAYOUT_DECODE_THREADS": "7"},
            (4, 2, "processes", 0),
        ),
        (
            EngineConfig(cores=4, mode="processes", workers=3),
            {"SCLAYOUT_DECODE": "threads"},
            (4, 1, "processes", 3),
        ),
    ],
    ids=["cores", "one-core", "workers", "env-cores", "env-mode", "field-wins", "mode-wins"],
)
def test_fields_left_none_come_from_the_environment(config, environ, expected):
    got = config.resolved(environ)  # a field given explicitly wins over the environment
    assert (got.cores, got.threads, got.mode, got.workers) == expected


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: EngineConfig(mode="gpu"), r"^mode='gpu': pass 'threads' or 'processes'"),
        (lambda: EngineConfig(threads=0), r"^threads=0: pass a whole number >= 1"),
        (lambda: EngineConfig(cores=True), r"^cores=True: pass a whole number >= 1"),
        (lambda: EngineConfig(workers=-1), r"^workers=-1: pass a whole number >= 0"),
        (lambda: Engine("threads"), r"^engine='threads': pass a loader.engine.EngineConfig"),
        (
            lambda: EngineConfig(workers=0).resolved({"SCLAYOUT_DECODE_THREADS": "0"}),
            r"^SCLAYOUT_DECODE_THREADS='0': set it to a whole number >= 1",
        ),
    ],
)
def test_a_bad_setting_is_a_one_line_error(make, message):
    with pytest.raises(InputError, match=message):
        make()


def test_engines_share_decoders_and_give_them_back():
    config = EngineConfig(threads=3, mode="threads", workers=0)
    a, b, other = Engine(config), Engine(config), Engine(EngineConfig(threads=1, mode="threads"))
    try:
        shared = a.decoders()
        assert b.decoders() is shared and shared.leases == 2  # one set for both readers
        assert other.decoders() is not shared  # another size: its own
        assert a.thread_pool().submit(sum, [1, 2]).result(timeout=30) == 3
        a.close()
        a.close()  # idempotent
        assert shared.leases == 1 and shared in running()
        with pytest.raises(InputError, match=r"^read after its reader was closed"):
            a.decoders()
        b.close()
        assert shared.leases == 0  # idle: the next engine of this size would take it over
        stop_idle()
        assert shared not in running()
        with pytest.raises(RuntimeError):  # its threads are shut down
            shared.pool.submit(sum, [1])
    finally:
        for engine in (a, b, other):
            engine.close()
        stop_idle()
