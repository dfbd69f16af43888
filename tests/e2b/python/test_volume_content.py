"""E2B's Volume content calls (e2b 2.63.0), unmodified, against a sandpit daemon.

The Rust test `e2b_sdk` runs this file with E2B_API_URL and E2B_VOLUME_API_URL pointing
at the daemon: the volume's token from `Volume.create` opens its files there. What a
hostile sandbox plants in a volume is tried by the Rust test `e2b_volume_content`.
"""

import os
import uuid

import pytest

os.environ.setdefault("E2B_VOLUME_API_URL", os.environ.get("E2B_API_URL", ""))

from e2b import Sandbox, Volume  # noqa: E402
from e2b.exceptions import NotFoundException, VolumeException  # noqa: E402
from e2b.volume.types import VolumeFileType  # noqa: E402


def unique(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def volume():
    vol = Volume.create(unique("content"))
    yield vol
    Volume.destroy(vol.volume_id)


def test_write_read_stat_list_remove(volume):
    st = volume.write_file("/notes/a.txt", "hello volume", force=True)
    assert st.name == "a.txt"
    assert st.path == "/notes/a.txt"
    assert st.type == VolumeFileType.FILE
    assert st.size == len("hello volume")
    assert (st.uid, st.gid, st.mode) == (1000, 1000, 0o644)
    assert volume.read_file("/notes/a.txt") == "hello volume"
    assert volume.read_file("notes/a.txt", format="bytes") == b"hello volume"
    assert b"".join(volume.read_file("/notes/a.txt", format="stream")) == b"hello volume"

    # Overwrite, binary content.
    blob = bytes(range(256)) * 64
    volume.write_file("/notes/a.txt", blob)
    assert volume.read_file("/notes/a.txt", format="bytes") == blob

    info = volume.get_info("/notes")
    assert info.type == VolumeFileType.DIRECTORY
    assert volume.exists("/notes/a.txt") is True
    assert volume.exists("/notes/missing") is False

    d = volume.make_dir("/notes/sub", mode=0o750)
    assert (d.type, d.mode, d.uid) == (VolumeFileType.DIRECTORY, 0o750, 1000)
    volume.make_dir("/deep/er/est", force=True)
    with pytest.raises(VolumeException):
        volume.make_dir("/notes/sub")

    top = volume.list("/")
    assert [e.path for e in top] == ["/deep", "/notes"]
    all_ = volume.list("/", depth=3)
    assert [e.path for e in all_] == [
        "/deep",
        "/deep/er",
        "/deep/er/est",
        "/notes",
        "/notes/a.txt",
        "/notes/sub",
    ]

    updated = volume.update_metadata("/notes/a.txt", uid=0, gid=0, mode=0o600)
    assert (updated.uid, updated.gid, updated.mode) == (0, 0, 0o600)
    assert volume.get_info("/notes/a.txt").mode == 0o600

    volume.remove("/notes")
    assert volume.exists("/notes") is False
    with pytest.raises(NotFoundException):
        volume.read_file("/notes/a.txt")
    with pytest.raises(NotFoundException):
        volume.remove("/notes")
    with pytest.raises(NotFoundException):
        volume.list("/notes")


def test_bad_requests_are_refused(volume):
    with pytest.raises(NotFoundException):
        volume.write_file("/no/parent.txt", "x")
    volume.make_dir("/d")
    with pytest.raises(VolumeException):
        volume.read_file("/d")
    with pytest.raises(VolumeException):
        volume.update_metadata("/d", uid=70000)
    with pytest.raises(VolumeException):
        volume.update_metadata("/d", mode=0o17777)
    with pytest.raises(VolumeException):
        volume.remove("/")


def test_tokens_open_their_own_volume_only(volume):
    other = Volume.create(unique("other"))
    try:
        other.write_file("/secret.txt", "other's")
        # This volume's token, pointed at the other volume.
        intruder = Volume(other.volume_id, other.name, token=volume.token)
        with pytest.raises(VolumeException):
            intruder.read_file("/secret.txt")
        bad = Volume(volume.volume_id, volume.name, token="sp_vol_" + "0" * 64)
        with pytest.raises(VolumeException):
            bad.list("/")
        # Connect gives the same token again.
        again = Volume.connect(volume.volume_id)
        assert again.token == volume.token
    finally:
        Volume.destroy(other.volume_id)


def test_files_cross_between_the_api_and_a_sandbox(volume):
    volume.write_file("/from-api.txt", "written by the API")
    sbx = Sandbox.create(volume_mounts={"/mnt/v": volume}, timeout=120)
    try:
        r = sbx.commands.run("cat /mnt/v/from-api.txt && echo && stat -c '%U %G %a' /mnt/v/from-api.txt")
        assert r.stdout == "written by the API\nuser user 644\n"
        sbx.commands.run("echo from the sandbox > /mnt/v/from-sbx.txt")
        sbx.commands.run("echo as root > /mnt/v/root.txt", user="root")
    finally:
        sbx.kill()
    assert volume.read_file("/from-sbx.txt") == "from the sandbox\n"
    st = volume.get_info("/from-sbx.txt")
    assert (st.uid, st.gid) == (1000, 1000)
    assert volume.get_info("/root.txt").uid == 0
