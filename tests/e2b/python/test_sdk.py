"""E2B's Python SDK (e2b 2.63.0), unmodified, against a sandpit daemon.

The Rust test `e2b_sdk` starts the daemon and runs this file with E2B_API_KEY,
E2B_API_URL and E2B_SANDBOX_URL pointing at it; nothing here knows it is not E2B.
"""

import os
import time
import uuid

import httpx
import pytest
from e2b import (
    CommandExitException,
    FileType,
    FilesystemEventType,
    PtySize,
    Sandbox,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)


@pytest.fixture
def sbx():
    s = Sandbox.create(timeout=300)
    yield s
    s.kill()


def test_create_with_metadata_and_env_vars():
    tag = uuid.uuid4().hex
    s = Sandbox.create(metadata={"suite": tag}, envs={"GREETING": "hello from env"})
    try:
        assert s.commands.run("echo $GREETING").stdout == "hello from env\n"
        info = s.get_info()
        assert info.metadata == {"suite": tag}
        assert info.sandbox_id == s.sandbox_id
        assert info.state == SandboxState.RUNNING
    finally:
        s.kill()


def test_foreground_command_output_and_exit_code(sbx):
    r = sbx.commands.run("echo out; echo err >&2; printf 'no newline'")
    assert r.stdout == "out\nno newline"
    assert r.stderr == "err\n"
    assert r.exit_code == 0


def test_commands_run_in_a_login_bash(sbx):
    # E2B runs commands as `/bin/bash -l -c`: bash syntax works and $0 is bash.
    r = sbx.commands.run("arr=(a b c); echo ${#arr[@]} ${arr[1]}; echo $0")
    assert r.stdout.split("\n")[0] == "3 b"
    assert "bash" in r.stdout.split("\n")[1]


def test_background_command_reconnected_from_a_new_client(sbx):
    h = sbx.commands.run("sleep 1.5; echo finished; exit 0", background=True)
    pid = h.pid
    assert pid > 0
    h.disconnect()
    # A different client object, as if the first process had gone away.
    other = Sandbox.connect(sbx.sandbox_id)
    listed = [p.pid for p in other.commands.list()]
    assert pid in listed
    r = other.commands.connect(pid).wait()
    assert r.stdout == "finished\n"
    assert r.exit_code == 0


def test_stdin_is_delivered_and_closed(sbx):
    h = sbx.commands.run("cat; echo eof-seen", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "line one\n")
    sbx.commands.send_stdin(h.pid, "line two\n")
    sbx.commands.close_stdin(h.pid)
    r = h.wait()
    assert r.stdout == "line one\nline two\neof-seen\n"


def test_cwd_envs_and_user(sbx):
    assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sbx.commands.run("echo $A-$B", envs={"A": "x", "B": "y"}).stdout == "x-y\n"
    assert sbx.commands.run("whoami").stdout == "user\n"
    assert sbx.commands.run("whoami", user="root").stdout == "root\n"
    assert sbx.commands.run("id -u", user="root").stdout == "0\n"


def test_sudo_and_python_as_in_e2b_base_image(sbx):
    # E2B's base image has passwordless sudo and `python`; scripts written for E2B use both.
    assert sbx.commands.run("sudo id -u; id -u").stdout == "0\n1000\n"
    assert sbx.commands.run("echo hi | sudo tee /etc/by-sudo >/dev/null; cat /etc/by-sudo").stdout == "hi\n"
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("sudo sh -c 'exit 7'")
    assert e.value.exit_code == 7
    assert sbx.commands.run("python -c 'print(6*7)'").stdout == "42\n"


def test_timeout_raises_the_sdk_timeout_error(sbx):
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30", timeout=1)
    assert time.monotonic() - started < 20


def test_non_zero_exit_raises_the_exit_error(sbx):
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("echo partial; exit 3")
    assert e.value.exit_code == 3
    assert e.value.stdout == "partial\n"


def test_kill_a_background_command(sbx):
    h = sbx.commands.run("sleep 60", background=True)
    assert sbx.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException) as e:
        h.wait()
    assert e.value.exit_code != 0


def test_pty_runs_an_interactive_shell(sbx):
    out = bytearray()
    h = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.send_stdin(h.pid, b"echo pty-$((6*7)); tty; exit\n")
    r = h.wait(on_pty=lambda data: out.extend(data))
    text = out.decode(errors="replace")
    assert "pty-42" in text
    assert "/dev/pts/" in text
    assert r.exit_code == 0


def test_files_write_and_read_text_and_bytes(sbx):
    info = sbx.files.write("/home/user/notes/hello.txt", "héllo wörld\n")
    assert info.path == "/home/user/notes/hello.txt"
    assert sbx.files.read("/home/user/notes/hello.txt") == "héllo wörld\n"
    blob = bytes(range(256)) * 64
    sbx.files.write("/home/user/blob.bin", blob)
    got = sbx.files.read("/home/user/blob.bin", format="bytes")
    assert bytes(got) == blob
    # The file is really there for processes in the sandbox.
    assert sbx.commands.run("wc -c < /home/user/blob.bin").stdout.strip() == str(len(blob))


def test_files_list_exists_rename_remove_make_dir(sbx):
    assert sbx.files.make_dir("/home/user/tree/a/b") is True
    sbx.files.write("/home/user/tree/top.txt", "1")
    sbx.files.write("/home/user/tree/a/mid.txt", "2")
    sbx.files.write("/home/user/tree/a/b/deep.txt", "3")

    shallow = {e.name for e in sbx.files.list("/home/user/tree")}
    assert shallow == {"a", "top.txt"}
    deep = {e.path for e in sbx.files.list("/home/user/tree", depth=2)}
    assert deep == {
        "/home/user/tree/a",
        "/home/user/tree/top.txt",
        "/home/user/tree/a/b",
        "/home/user/tree/a/mid.txt",
    }
    kinds = {e.name: e.type for e in sbx.files.list("/home/user/tree")}
    assert kinds["a"] == FileType.DIR
    assert kinds["top.txt"] == FileType.FILE

    assert sbx.files.exists("/home/user/tree/top.txt") is True
    assert sbx.files.exists("/home/user/tree/nope.txt") is False
    moved = sbx.files.rename("/home/user/tree/top.txt", "/home/user/tree/renamed.txt")
    assert moved.path == "/home/user/tree/renamed.txt"
    assert sbx.files.exists("/home/user/tree/top.txt") is False
    assert sbx.files.read("/home/user/tree/renamed.txt") == "1"
    sbx.files.remove("/home/user/tree/a")
    assert sbx.files.exists("/home/user/tree/a/mid.txt") is False
    assert {e.name for e in sbx.files.list("/home/user/tree")} == {"renamed.txt"}


def test_watch_dir_reports_events(sbx):
    sbx.files.make_dir("/home/user/watched")
    w = sbx.files.watch_dir("/home/user/watched")
    try:
        sbx.files.write("/home/user/watched/new.txt", "x")
        sbx.commands.run("rm /home/user/watched/new.txt")
        seen = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            seen.extend(w.get_new_events())
            kinds = {(e.name, e.type) for e in seen}
            if ("new.txt", FilesystemEventType.REMOVE) in kinds:
                break
            time.sleep(0.2)
        kinds = {(e.name, e.type) for e in seen}
        assert ("new.txt", FilesystemEventType.CREATE) in kinds
        assert ("new.txt", FilesystemEventType.REMOVE) in kinds
    finally:
        w.stop()


def test_set_timeout_moves_the_end(sbx):
    before = sbx.get_info().end_at
    sbx.set_timeout(1200)
    after = sbx.get_info().end_at
    assert (after - before).total_seconds() > 800


def test_kill_removes_the_sandbox():
    s = Sandbox.create()
    sid = s.sandbox_id
    assert s.kill() is True
    ids = [i.sandbox_id for i in Sandbox.list().next_items()]
    assert sid not in ids
    # A second kill finds nothing to kill.
    assert Sandbox.kill(sid) is False


def test_list_with_a_metadata_filter():
    tag = uuid.uuid4().hex
    a = Sandbox.create(metadata={"group": tag, "n": "1"})
    b = Sandbox.create(metadata={"group": tag, "n": "2"})
    c = Sandbox.create(metadata={"group": "other"})
    try:
        found = Sandbox.list(query=SandboxQuery(metadata={"group": tag})).next_items()
        assert {i.sandbox_id for i in found} == {a.sandbox_id, b.sandbox_id}
        one = Sandbox.list(query=SandboxQuery(metadata={"group": tag, "n": "2"})).next_items()
        assert [i.sandbox_id for i in one] == [b.sandbox_id]
        # Pagination: one per page, both pages reached through the next token.
        pager = Sandbox.list(query=SandboxQuery(metadata={"group": tag}), limit=1)
        pages = []
        while pager.has_next:
            pages.append([i.sandbox_id for i in pager.next_items()])
        assert sorted(sum(pages, [])) == sorted([a.sandbox_id, b.sandbox_id])
        assert all(len(p) <= 1 for p in pages)
    finally:
        for s in (a, b, c):
            s.kill()


def test_pause_then_connect_keeps_files_and_env():
    s = Sandbox.create(envs={"KEPT": "still-here"})
    try:
        s.files.write("/home/user/state.txt", "before pause")
        bg = s.commands.run("sleep 600", background=True)
        assert s.pause() is True
        state = s.get_info().state
        assert state == SandboxState.PAUSED
        # Pausing a paused sandbox is not an error for the SDK; it answers False.
        assert s.pause() is False
        again = Sandbox.connect(s.sandbox_id)
        assert again.get_info().state == SandboxState.RUNNING
        assert again.files.read("/home/user/state.txt") == "before pause"
        assert again.commands.run("echo $KEPT").stdout == "still-here\n"
        # The memory was kept: the background process is the same one.
        assert bg.pid in [p.pid for p in again.commands.list()]
    finally:
        s.kill()


def test_snapshot_and_create_from_it():
    s = Sandbox.create()
    try:
        s.files.write("/home/user/snap.txt", "in the snapshot")
        s.commands.run("mkdir -p /home/user/pkg && echo built > /home/user/pkg/out")
        snap = s.create_snapshot()
        assert snap.snapshot_id
        listed = [i.snapshot_id for i in Sandbox.list_snapshots().next_items()]
        assert snap.snapshot_id in listed
        s.files.write("/home/user/snap.txt", "changed after")
        child = Sandbox.create(snap.snapshot_id)
        try:
            assert child.files.read("/home/user/snap.txt") == "in the snapshot"
            assert child.commands.run("cat /home/user/pkg/out").stdout == "built\n"
        finally:
            child.kill()
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False
    finally:
        s.kill()


def test_get_host_reaches_a_server_in_the_sandbox(sbx):
    sbx.files.write("/home/user/site/index.html", "served from the sandbox")
    sbx.commands.run(
        "cd /home/user/site && python3 -m http.server 8123 --bind 127.0.0.1",
        background=True,
    )
    host = sbx.get_host(8123)
    assert host == f"8123-{sbx.sandbox_id}.{sbx.sandbox_domain}"
    base = os.environ["E2B_SANDBOX_URL"]
    headers = {"Host": host}
    if sbx.traffic_access_token:
        headers["E2B-Traffic-Access-Token"] = sbx.traffic_access_token
    body = None
    for _ in range(50):
        r = httpx.get(base + "/index.html", headers=headers)
        if r.status_code == 200:
            body = r.text
            break
        time.sleep(0.1)
    assert body == "served from the sandbox"
    # The same port in E2B's header form.
    r = httpx.get(
        base + "/index.html",
        headers={
            "E2b-Sandbox-Id": sbx.sandbox_id,
            "E2b-Sandbox-Port": "8123",
            **({"E2B-Traffic-Access-Token": sbx.traffic_access_token} if sbx.traffic_access_token else {}),
        },
    )
    assert r.status_code == 200
    assert r.text == "served from the sandbox"
