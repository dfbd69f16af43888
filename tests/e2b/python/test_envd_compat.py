"""envd behaviours E2B's Python SDK (e2b 2.63.0) relies on, against a sandpit daemon.

Run by the Rust test `e2b_sdk` with E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL set;
sandpit's own scenarios, one per behaviour: gzip transfers, file metadata in
`user.e2b.*` attributes, idempotent removal, relative working directories, `/proc`
reads, kill of an ended command, `Connect-Timeout-Ms` on streams, a sandbox killed
under a running command, and recursive watches. The attacks on the same paths (header
names outside the namespace, bombs, symlinks) are in `crates/tests/tests/e2b_envd.rs`.
"""

import asyncio
import io
import time
import uuid

import pytest
from e2b import (
    AsyncSandbox,
    FilesystemEventType,
    InvalidArgumentException,
    Sandbox,
    TimeoutException,
)
from e2b.sandbox.filesystem.filesystem import WriteEntry


@pytest.fixture
def sbx():
    s = Sandbox.create(timeout=300)
    yield s
    s.kill()


def test_gzip_writes_are_stored_decoded_and_reads_may_ask_for_gzip(sbx):
    text = "compressed on the wire, plain on disk\n" * 500
    info = sbx.files.write("gz/plain.txt", text, gzip=True)
    assert info.path == "/home/user/gz/plain.txt"
    # Checked inside the sandbox, not through the SDK: the bytes on disk are plain.
    assert sbx.commands.run("cat gz/plain.txt").stdout == text
    assert sbx.commands.run("head -c 2 gz/plain.txt").stdout == "co"
    assert sbx.files.read("gz/plain.txt") == text
    assert sbx.files.read("gz/plain.txt", gzip=True) == text
    assert bytes(sbx.files.read("gz/plain.txt", format="bytes", gzip=True)) == text.encode()
    # Several files, and a streamed file-like body, each decoded.
    infos = sbx.files.write_files(
        [WriteEntry(path=f"gz/{i}.txt", data=f"file {i}") for i in range(3)], gzip=True
    )
    assert [i.path for i in infos] == [f"/home/user/gz/{i}.txt" for i in range(3)]
    for i in range(3):
        assert sbx.files.read(f"gz/{i}.txt") == f"file {i}"
    big = bytes(range(256)) * 4096
    sbx.files.write("gz/stream.bin", io.BytesIO(big), use_octet_stream=True, gzip=True)
    assert bytes(sbx.files.read("gz/stream.bin", format="bytes")) == big
    assert sbx.commands.run("stat -c %s gz/stream.bin").stdout.strip() == str(len(big))


def test_metadata_is_written_listed_renamed_and_cleared(sbx):
    meta = {"author": "mish", "purpose": "upload"}
    info = sbx.files.write("meta/a.txt", "a", metadata=meta)
    assert info.metadata == meta
    assert sbx.files.get_info("meta/a.txt").metadata == meta
    # Multipart too, one set applied to every file.
    infos = sbx.files.write_files(
        [WriteEntry(path="meta/b.txt", data="b"), WriteEntry(path="meta/c.txt", data="c")],
        metadata={"source": "suite"},
        use_octet_stream=False,
    )
    assert [i.metadata for i in infos] == [{"source": "suite"}] * 2
    listed = {e.name: e.metadata for e in sbx.files.list("meta")}
    assert listed == {"a.txt": meta, "b.txt": {"source": "suite"}, "c.txt": {"source": "suite"}}
    moved = sbx.files.rename("meta/a.txt", "meta/moved.txt")
    assert moved.metadata == meta
    # Keys are lowercased, as envd does; the attribute names carry the prefix.
    sbx.files.write("meta/case.txt", "x", metadata={"MixedCase": "v"})
    assert sbx.files.get_info("meta/case.txt").metadata == {"mixedcase": "v"}
    attrs = sbx.commands.run(
        "python3 -c \"import os; print(sorted(os.listxattr('meta/case.txt')))\""
    ).stdout.strip()
    assert attrs == "['user.e2b.mixedcase']"
    # An overwrite without metadata leaves none behind.
    assert sbx.files.write("meta/moved.txt", "again").metadata is None
    assert sbx.files.get_info("meta/moved.txt").metadata is None
    # Set inside the sandbox: reported; other user.* attributes are not.
    sbx.files.write("meta/x.txt", "x")
    sbx.commands.run(
        "python3 -c \"import os; os.setxattr('meta/x.txt', 'user.e2b.k', b'v'); "
        "os.setxattr('meta/x.txt', 'user.other', b'no')\""
    )
    assert sbx.files.get_info("meta/x.txt").metadata == {"k": "v"}
    # A symlink reports what its target carries.
    sbx.commands.run("ln -s x.txt meta/link")
    assert sbx.files.get_info("meta/link").metadata == {"k": "v"}


def test_removing_what_is_not_there_is_done(sbx):
    sbx.files.remove("never-existed.txt")
    sbx.files.remove("no/such/dir/file")
    sbx.files.write("once.txt", "x")
    sbx.files.remove("once.txt")
    sbx.files.remove("once.txt")
    assert not sbx.files.exists("once.txt")


def test_relative_cwd_is_taken_from_the_users_home(sbx):
    sbx.files.make_dir("work/sub")
    assert sbx.commands.run("pwd", cwd="work/sub").stdout == "/home/user/work/sub\n"
    assert sbx.commands.run("pwd", cwd="~/work").stdout == "/home/user/work\n"
    assert sbx.commands.run("pwd", cwd="~").stdout == "/home/user\n"
    assert sbx.commands.run("pwd", cwd="work/../work/./sub").stdout == "/home/user/work/sub\n"
    # Root's home is /root: a relative path there names /root/...
    sbx.commands.run("mkdir -p /root/rw", user="root")
    assert sbx.commands.run("pwd", cwd="rw", user="root").stdout == "/root/rw\n"
    with pytest.raises(InvalidArgumentException):
        sbx.commands.run("pwd", cwd="no/such/dir")
    with pytest.raises(InvalidArgumentException):
        sbx.commands.run("pwd", cwd="../../../..")
    with pytest.raises(InvalidArgumentException):
        sbx.commands.run("pwd", cwd="~root")
    # A link that leads nowhere is a missing directory too.
    sbx.commands.run("ln -s /nowhere dangling")
    with pytest.raises(InvalidArgumentException):
        sbx.commands.run("pwd", cwd="dangling")


def test_proc_files_are_read_to_their_end(sbx):
    status = sbx.files.read("/proc/self/status")
    assert "Name:" in status and "Pid:" in status
    assert sbx.files.read("/proc/version").startswith("Linux version")
    assert "Name:" in sbx.files.read("/proc/self/status", gzip=True)


def test_kill_of_an_ended_command_is_false(sbx):
    h = sbx.commands.run("true", background=True)
    h.wait()
    assert sbx.commands.kill(h.pid) is False
    assert sbx.commands.kill(999_999) is False
    h = sbx.commands.run("sleep 30", background=True)
    assert sbx.commands.kill(h.pid) is True


def test_a_command_timeout_ends_the_stream_and_the_command(sbx):
    marker = f"/tmp/late-{uuid.uuid4().hex}"

    async def run():
        a = await AsyncSandbox.connect(sbx.sandbox_id)
        started = time.monotonic()
        with pytest.raises(TimeoutException):
            await a.commands.run(f"sleep 4; touch {marker}", timeout=1)
        return time.monotonic() - started

    took = asyncio.run(run())
    assert took < 3.5, took
    with pytest.raises(TimeoutException):
        sbx.commands.run(f"sleep 4; touch {marker}", timeout=1)
    time.sleep(4)
    # Killed at the timeout, as E2B's envd kills it: the touch never ran.
    assert not sbx.files.exists(marker)
    # Without a timeout (0) a command runs as long as it takes.
    assert sbx.commands.run("sleep 1.5; echo done", timeout=0).stdout == "done\n"


def test_a_sandbox_killed_under_a_command_reads_as_killed():
    s = Sandbox.create(timeout=120)
    h = s.commands.run("sleep 60", background=True)
    s.kill()
    with pytest.raises(TimeoutException) as e:
        h.wait()
    assert "sandbox was killed or reached its end of life" in str(e.value)


def test_recursive_watch_sees_nested_writes(sbx):
    sbx.files.make_dir("w/nested")
    h = sbx.files.watch_dir("w", recursive=True)
    sbx.files.write("w/nested/f.txt", "x")
    sbx.files.make_dir("w/later")
    sbx.files.write("w/later/g.txt", "y")
    time.sleep(0.5)
    events = h.get_new_events()
    h.stop()
    names = {(e.type, e.name) for e in events}
    assert (FilesystemEventType.CREATE, "nested/f.txt") in names, names
    assert (FilesystemEventType.WRITE, "nested/f.txt") in names, names
    assert (FilesystemEventType.CREATE, "later") in names, names
    assert (FilesystemEventType.WRITE, "later/g.txt") in names, names
