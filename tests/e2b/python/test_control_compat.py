"""E2B's control-plane defaults through E2B's Python SDK (e2b 2.63.0), unmodified.

Where E2B's defaults differ from sandpit's own API, a sandbox created through E2B's API
behaves as on E2B: no lifecycle means kill at the timeout and no auto-resume, ports are
public unless `allow_public_traffic` is False, `set_timeout(0)` ends the sandbox's time
now, lists are newest first with an inclusive `started_after`, and a failed MCP gateway
start leaves no sandbox. Run by the Rust test `e2b_sdk` like the other scenario files.
"""

import os
import time
import uuid

import httpx
import pytest
from e2b import (
    Sandbox,
    SandboxException,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)


def boot_id(s):
    return s.commands.run("cat /proc/sys/kernel/random/boot_id").stdout.strip()


def wait_state(s, want, seconds=30):
    for _ in range(seconds * 10):
        if s.get_info().state == want:
            return
        time.sleep(0.1)
    assert s.get_info().state == want


def serve(s, port):
    s.files.write("/home/user/www/index.html", "from " + s.sandbox_id)
    s.commands.run(
        f"cd /home/user/www && python3 -m http.server {port} --bind 127.0.0.1",
        background=True,
    )
    s.commands.run(
        f"for i in $(seq 200); do (exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && exit 0; sleep 0.05; done; exit 1"
    )


def get_port(s, port, token=None):
    headers = {"Host": s.get_host(port)}
    if token is not None:
        headers["E2B-Traffic-Access-Token"] = token
    return httpx.get(os.environ["E2B_SANDBOX_URL"] + "/index.html", headers=headers, timeout=60)


def test_a_health_probe_does_not_wake_a_sandbox_paused_by_hand():
    s = Sandbox.create(timeout=120)
    try:
        info = s.get_info()
        assert info.lifecycle == {"on_timeout": "kill", "auto_resume": False}
        assert s.pause() is True
        # is_running() probes envd: without auto-resume it must not wake the sandbox.
        assert not s.is_running()
        assert s.get_info().state == SandboxState.PAUSED
        again = Sandbox.connect(s.sandbox_id)
        assert again.is_running()
        assert again.get_info().state == SandboxState.RUNNING
    finally:
        s.kill()


def test_auto_resume_wakes_a_paused_sandbox_on_a_port_request():
    s = Sandbox.create(timeout=4, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        assert s.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": True}
        serve(s, 8124)
        wait_state(s, SandboxState.PAUSED)
        # Public by default: no token, and the request itself wakes the sandbox.
        r = get_port(s, 8124)
        assert r.status_code == 200
        assert r.text == "from " + s.sandbox_id
        assert s.get_info().state == SandboxState.RUNNING
    finally:
        s.kill()


def test_set_timeout_zero_kills_a_sandbox_without_lifecycle():
    s = Sandbox.create(timeout=120)
    s.set_timeout(0)
    assert not s.is_running()
    assert s.sandbox_id not in [i.sandbox_id for i in Sandbox.list().next_items()]
    assert Sandbox.kill(s.sandbox_id) is False


def test_set_timeout_zero_pauses_with_memory_and_files_only():
    s = Sandbox.create(timeout=120, lifecycle={"on_timeout": "pause"})
    fs = Sandbox.create(
        timeout=120, lifecycle={"on_timeout": {"action": "pause", "keep_memory": False}}
    )
    try:
        before, fs_before = boot_id(s), boot_id(fs)
        bg = s.commands.run("sleep 600", background=True)
        s.set_timeout(0)
        fs.set_timeout(0)
        for x in (s, fs):
            assert not x.is_running()
            assert x.get_info().state == SandboxState.PAUSED
        again = s.connect()
        assert boot_id(again) == before
        assert bg.pid in [p.pid for p in again.commands.list()]
        # A files-only pause restarts the sandbox: its processes and boot id are new.
        fs_again = fs.connect()
        assert boot_id(fs_again) != fs_before
    finally:
        s.kill()
        fs.kill()


def test_list_is_newest_first_with_an_inclusive_start_and_pages():
    tag = uuid.uuid4().hex
    made = []
    try:
        for _ in range(3):
            made.append(Sandbox.create(timeout=120, metadata={"tag": tag}))
            time.sleep(0.02)
        ids = [s.sandbox_id for s in made]
        q = SandboxQuery(metadata={"tag": tag})
        assert [i.sandbox_id for i in Sandbox.list(query=q).next_items()] == ids[::-1]
        assert [i.sandbox_id for i in Sandbox.list(query=q, order="asc").next_items()] == ids
        pager = Sandbox.list(query=q, limit=1)
        pages = []
        while pager.has_next:
            pages.append([i.sandbox_id for i in pager.next_items()])
        assert pages == [[ids[2]], [ids[1]], [ids[0]]]
        started = made[1].get_info().started_at
        after = Sandbox.list(query=SandboxQuery(metadata={"tag": tag}, started_after=started))
        assert [i.sandbox_id for i in after.next_items()] == [ids[2], ids[1]]
        # Paused first on a mixed filter when it is the newest.
        made[2].pause()
        mixed = Sandbox.list(
            query=SandboxQuery(
                metadata={"tag": tag}, state=[SandboxState.RUNNING, SandboxState.PAUSED]
            ),
            limit=1,
        )
        first = mixed.next_items()
        assert [(i.sandbox_id, i.state) for i in first] == [(ids[2], SandboxState.PAUSED)]
    finally:
        for s in made:
            s.kill()


def test_ports_are_public_by_default_and_private_ones_need_the_token():
    open_ = Sandbox.create(timeout=120)
    closed = Sandbox.create(timeout=120, network={"allow_public_traffic": False})
    try:
        serve(open_, 8125)
        serve(closed, 8125)
        assert get_port(open_, 8125).status_code == 200
        for bad in (None, "wrong", open_.traffic_access_token):
            assert get_port(closed, 8125, bad).status_code in (401, 403), bad
        r = get_port(closed, 8125, closed.traffic_access_token)
        assert r.status_code == 200
        assert r.text == "from " + closed.sandbox_id
    finally:
        open_.kill()
        closed.kill()


def test_a_failed_mcp_gateway_start_leaves_no_sandbox():
    tag = uuid.uuid4().hex
    # The base template has no `mcp-gateway`: the SDK's start of it fails, and the SDK
    # kills the sandbox it had made.
    with pytest.raises(SandboxException, match="Failed to start MCP gateway"):
        Sandbox.create("base", timeout=60, metadata={"mcp": tag}, mcp={"some_server": {}})
    # Without a template the SDK asks for E2B's `mcp-gateway` template, which sandpit has
    # only if the operator maps it (`[e2b.templates]`): a clear 404, nothing made.
    with pytest.raises(SandboxException, match="mcp-gateway"):
        Sandbox.create(timeout=60, metadata={"mcp": tag}, mcp={"some_server": {}})
    left = Sandbox.list(query=SandboxQuery(metadata={"mcp": tag})).next_items()
    assert left == []


def test_a_command_cut_off_by_a_kill_reports_the_sandbox_gone():
    s = Sandbox.create(timeout=120)
    h = s.commands.run("sleep 60", background=True)
    s.kill()
    # The stream's connection is reset, the SDK's health probe finds no sandbox, and it
    # says so rather than reporting a malformed answer.
    with pytest.raises(TimeoutException, match="killed or reached its end of life"):
        h.wait()
