"""E2B's Python SDK (e2b 2.63.0), unmodified: `get_metrics(start, end)` against the
sandbox metrics history a sandpit daemon keeps (a sample every 5 s by default).

Run by the Rust test `e2b_sdk` with E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL set.
"""

import asyncio
import datetime
import time

import pytest
from e2b import AsyncSandbox, Sandbox, SandboxException
from e2b.exceptions import NotFoundException

BUSY_PCT = 5.0


def now():
    return datetime.datetime.now(datetime.timezone.utc)


def wait_for(fetch, done, what, secs=60):
    deadline = time.monotonic() + secs
    while True:
        got = fetch()
        if done(got):
            return got
        assert time.monotonic() < deadline, f"never: {what}: {got}"
        time.sleep(0.5)


def test_history_holds_a_cpu_loop_in_its_range_only():
    created = now()
    sbx = Sandbox.create(timeout=300)
    try:
        first = wait_for(sbx.get_metrics, lambda m: len(m) >= 1, "a first sample")
        m = first[0]
        assert m.cpu_count == 1
        assert 0.0 <= m.cpu_used_pct <= 100.0
        assert 0 < m.mem_used <= m.mem_total
        assert m.mem_cache >= 0
        assert 0 < m.disk_used <= m.disk_total
        assert m.timestamp.tzinfo is not None
        assert m.timestamp >= created - datetime.timedelta(seconds=1)

        # Idle samples to compare with, and a second between them and the loop, so that
        # a range ending a second before the loop (E2B's ranges are whole seconds) has them.
        wait_for(sbx.get_metrics, lambda m: len(m) >= 2, "idle samples")
        time.sleep(2)
        # Twelve seconds of a busy loop hold at least one whole 5 s sample.
        t0 = now()
        r = sbx.commands.run("timeout 12 sh -c 'while :; do :; done'; echo done", timeout=60)
        assert r.stdout == "done\n"
        t1 = now()
        wait_for(
            sbx.get_metrics,
            lambda ms: any(x.timestamp > t1 + datetime.timedelta(seconds=1) for x in ms),
            "a sample after the loop",
        )
        # E2B's ranges are whole seconds: start is rounded down, so start one second late.
        during = sbx.get_metrics(start=t0 + datetime.timedelta(seconds=1), end=t1)
        assert during, "no samples during the loop"
        for x in during:
            assert t0 <= x.timestamp < t1 + datetime.timedelta(seconds=1), x
        assert max(x.cpu_used_pct for x in during) > BUSY_PCT, during

        everything = sbx.get_metrics()
        assert [x.timestamp for x in everything] == sorted(x.timestamp for x in everything)
        assert len(everything) > len(during)
        # The samples before the loop began are all idle.
        idle = sbx.get_metrics(end=t0 - datetime.timedelta(seconds=1))
        assert idle, everything
        assert all(x.cpu_used_pct < BUSY_PCT for x in idle), idle

        # Nothing before the sandbox existed; the class method reads the same history.
        assert sbx.get_metrics(
            start=created - datetime.timedelta(hours=1),
            end=created - datetime.timedelta(minutes=30),
        ) == []
        by_id = Sandbox.get_metrics(sbx.sandbox_id, start=t0 + datetime.timedelta(seconds=1), end=t1)
        assert [x.timestamp for x in by_id] == [x.timestamp for x in during]

        # A range that ends before it starts is refused, not answered empty.
        with pytest.raises(SandboxException) as bad:
            sbx.get_metrics(start=t1, end=t0 - datetime.timedelta(seconds=5))
        assert "before" in str(bad.value)
    finally:
        sbx.kill()
    with pytest.raises(NotFoundException):
        Sandbox.get_metrics(sbx.sandbox_id)


def test_a_paused_sandbox_keeps_its_history_and_is_not_sampled():
    sbx = Sandbox.create(timeout=300)
    try:
        wait_for(sbx.get_metrics, lambda m: len(m) >= 1, "a first sample")
        sbx.pause()
        paused = now()
        time.sleep(12)
        kept = Sandbox.get_metrics(sbx.sandbox_id)
        assert kept, "the history of a paused sandbox is still there"
        late = [x for x in kept if x.timestamp > paused + datetime.timedelta(seconds=2)]
        assert late == [], late
    finally:
        sbx.kill()


def test_async_get_metrics_reads_the_same_history():
    async def scenario():
        sbx = await AsyncSandbox.create(timeout=300)
        try:
            deadline = time.monotonic() + 60
            while True:
                got = await sbx.get_metrics()
                if got:
                    break
                assert time.monotonic() < deadline, "no sample"
                await asyncio.sleep(0.5)
            ranged = await sbx.get_metrics(start=got[0].timestamp, end=now())
            assert ranged and ranged[0].timestamp == got[0].timestamp
        finally:
            await sbx.kill()

    asyncio.run(scenario())
