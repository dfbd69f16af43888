"""E2B's Secret and Volume classes (e2b 2.63.0), unmodified, against a sandpit daemon.

The Rust test `e2b_sdk` starts the daemon (with a broker key) and runs this file with
E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL pointing at it. The volume-content client
goes to E2B_VOLUME_API_URL, pointed at the daemon here too, so that nothing leaves this
machine. That a rule's secret reaches an upstream is shown by the Rust test
`e2b_secrets` (it needs a network namespace this file cannot make).
"""

import os
import uuid

import pytest

os.environ.setdefault("E2B_VOLUME_API_URL", os.environ.get("E2B_API_URL", ""))

from e2b import Sandbox, Secret, Volume  # noqa: E402
from e2b.exceptions import (  # noqa: E402
    SandboxException,
    SecretException,
    SecretNotFoundException,
    VolumeException,
)

VALUE = "sk-sandpit-sdk-" + uuid.uuid4().hex


def unique(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def secret():
    name = unique("sdk-secret")
    info = Secret.create(name, VALUE, metadata={"suite": "sandpit"})
    yield info
    Secret.destroy(info.secret_id)


def test_secret_lifecycle_without_the_value(secret):
    assert secret.secret_id.startswith("sec_")
    assert secret.version == 1
    assert secret.metadata == {"suite": "sandpit"}
    assert VALUE not in repr(secret)
    by_id = Secret.get_info(secret.secret_id)
    by_name = Secret.get_info(secret.name.upper())
    assert by_id == by_name
    assert Secret.exists(secret.name) is True
    updated = Secret.update(secret.secret_id, VALUE + "-v2", metadata={"rotated": "yes"})
    assert updated.version == 2
    assert updated.metadata == {"rotated": "yes"}
    assert updated.secret_id == secret.secret_id
    assert updated.created_at == secret.created_at
    assert updated.updated_at >= secret.updated_at


def test_missing_secrets_are_not_found():
    missing = unique("missing")
    assert Secret.exists(missing) is False
    assert Secret.destroy(missing) is False
    with pytest.raises(SecretNotFoundException):
        Secret.get_info(missing)
    with pytest.raises(SecretNotFoundException):
        Secret.update(missing, "v")


def test_bad_secrets_and_duplicates_are_refused(secret):
    with pytest.raises(SecretException):
        Secret.create(secret.name, "again")
    for name, value in [("sec_reserved", "v"), ("has space", "v"), ("ok-name", "")]:
        with pytest.raises(SecretException):
            Secret.create(name, value)


def test_secrets_are_listed_a_page_at_a_time():
    names = sorted(unique("page") for _ in range(3))
    created = [Secret.create(n, "v") for n in names]
    try:
        seen = []
        paginator = Secret.list(limit=2)
        pages = 0
        while paginator.has_next:
            page = paginator.next_items()
            assert len(page) <= 2
            seen.extend(s.name for s in page)
            pages += 1
        assert pages >= 2
        assert all(n in seen for n in names)
        assert seen == sorted(seen)
    finally:
        for c in created:
            assert Secret.destroy(c.secret_id) is True


def test_a_sandbox_sees_only_the_placeholder(secret):
    placeholder = Secret.fill(secret.name)
    sbx = Sandbox.create(
        envs={"TOKEN": placeholder},
        network={
            "rules": {
                "api.example.com": [
                    {"transform": {"headers": {"Authorization": f"Bearer {placeholder}"}}}
                ]
            }
        },
        timeout=120,
    )
    try:
        assert sbx.commands.run("echo $TOKEN").stdout == placeholder + "\n"
        # The needle reversed, so the search's own command line does not hold it.
        rev = VALUE[::-1]
        found = sbx.commands.run(
            f"X='{rev}'; n() {{ printf '%s\\n' \"$X\" | rev; }}; "
            "{ cat /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null; ps -eo args; env; } "
            "| grep -c -F -f <(n); true"
        )
        assert found.stdout.strip() == "0"
        info = sbx.get_info()
        assert VALUE not in repr(info)
        shown = info.network["rules"]["api.example.com"][0]["transform"]["headers"]
        assert shown == {"Authorization": f"Bearer {placeholder}"}
        # A rule update replaces the rules; naming an unknown secret is refused.
        sbx.update_network({"rules": {"api.example.org": [{"transform": {"headers": {"X-A": "1"}}}]}})
        assert list(sbx.get_info().network["rules"]) == ["api.example.org"]
        with pytest.raises(SandboxException):
            sbx.update_network(
                {"rules": {"api.example.org": [{"transform": {"headers": {"X-A": Secret.fill(unique("nope"))}}}]}}
            )
    finally:
        sbx.kill()


def test_rules_naming_an_unknown_secret_make_no_sandbox():
    before = {s.sandbox_id for s in Sandbox.list().next_items()}
    with pytest.raises(SandboxException) as err:
        Sandbox.create(
            network={
                "rules": {
                    "api.example.com": [
                        {"transform": {"headers": {"Authorization": Secret.fill(unique("absent"))}}}
                    ]
                }
            }
        )
    assert "400" in str(err.value)
    after = {s.sandbox_id for s in Sandbox.list().next_items()}
    assert after == before


@pytest.fixture
def volume():
    vol = Volume.create(unique("vol"))
    yield vol
    Volume.destroy(vol.volume_id)


def test_volume_lifecycle(volume):
    assert any(v.volume_id == volume.volume_id and v.name == volume.name for v in Volume.list())
    info = Volume.get_info(volume.volume_id)
    assert (info.volume_id, info.name) == (volume.volume_id, volume.name)
    again = Volume.connect(volume.volume_id)
    assert again.name == volume.name
    with pytest.raises(VolumeException):
        Volume.create(volume.name)
    gone = Volume.create(unique("gone"))
    assert Volume.destroy(gone.volume_id) is True
    assert Volume.destroy(gone.volume_id) is False


def test_a_volume_keeps_files_across_sandboxes(volume):
    first = Sandbox.create(volume_mounts={"/mnt/data": volume}, timeout=120)
    try:
        first.files.write("/mnt/data/note.txt", "kept across sandboxes")
        assert first.get_info().volume_mounts == [{"name": volume.name, "path": "/mnt/data"}]
    finally:
        first.kill()
    second = Sandbox.create(volume_mounts={"/home/user/data": volume.name}, timeout=120)
    try:
        assert second.files.read("/home/user/data/note.txt") == "kept across sandboxes"
    finally:
        second.kill()


def test_mount_paths_over_the_system_are_refused(volume):
    for path in ["/etc", "/usr/lib", "relative", "/mnt/../proc", "/.sandpit"]:
        with pytest.raises(SandboxException):
            Sandbox.create(volume_mounts={path: volume})
