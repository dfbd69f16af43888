"""E2B template builds through the Python SDK (e2b 2.63.0), unmodified, against sandpit.

`Template()...build()` uploads the COPY sources to the URL the daemon gives, starts the
build and follows its logs; a sandbox started from the result must show every step's
effect. The daemon's base template is `host` here, whose top level is read-only, so the
steps write under /home/user, /opt and /tmp.
"""

import os
import tempfile
import time
import uuid

import pytest
from e2b import (
    BuildException,
    Sandbox,
    Template,
    wait_for_file,
)


@pytest.fixture
def context_dir():
    d = tempfile.mkdtemp(prefix="sandpit-e2b-ctx-")
    os.makedirs(os.path.join(d, "app", "sub"))
    with open(os.path.join(d, "app", "hello.txt"), "w") as f:
        f.write("hello from the build context\n")
    with open(os.path.join(d, "app", "sub", "deep.txt"), "w") as f:
        f.write("deep\n")
    script = os.path.join(d, "app", "tool.sh")
    with open(script, "w") as f:
        f.write("#!/bin/sh\necho tool ran\n")
    os.chmod(script, 0o755)
    os.symlink("hello.txt", os.path.join(d, "app", "link.txt"))
    with open(os.path.join(d, "config.ini"), "w") as f:
        f.write("[x]\ny=1\n")
    return d


def unique(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def test_a_built_template_starts_sandboxes_with_every_step_applied(context_dir):
    name = unique("sdk-build")
    logs = []
    template = (
        Template(file_context_path=context_dir)
        .from_base_image()
        .copy("app", "/home/user/app")
        .copy("config.ini", "/home/user/conf/settings.ini", mode=0o600)
        .set_envs({"GREETING": "hello from ENV"})
        .run_cmd('echo "$GREETING" > /home/user/greeting.txt')
        .run_cmd("id -un > /opt/made-by-root", user="root")
        .make_dir("/home/user/data/cache")
        .make_symlink("/home/user/app/hello.txt", "/home/user/hello-link")
        .set_workdir("/home/user/app")
        .run_cmd("pwd > /home/user/step-cwd")
        .set_start_cmd("echo started > /tmp/started", wait_for_file("/tmp/started"))
    )
    info = Template.build(
        template, f"{name}:v1", cpu_count=1, memory_mb=512, on_build_logs=logs.append
    )
    assert info.template_id and info.build_id
    assert "v1" in info.tags
    messages = [l.message for l in logs]
    assert any("RUN" in m for m in messages), messages
    assert Template.exists(name)

    s = Sandbox.create(f"{name}:v1", timeout=120)
    try:
        run = lambda cmd, **kw: s.commands.run(cmd, **kw).stdout
        assert run("cat /home/user/app/hello.txt") == "hello from the build context\n"
        assert run("cat /home/user/app/sub/deep.txt") == "deep\n"
        assert run("/home/user/app/tool.sh") == "tool ran\n"
        assert run("readlink /home/user/app/link.txt") == "hello.txt\n"
        assert run("stat -c %a /home/user/conf/settings.ini") == "600\n"
        assert run("cat /home/user/greeting.txt") == "hello from ENV\n"
        assert run("cat /opt/made-by-root") == "root\n"
        assert run("test -d /home/user/data/cache && echo yes") == "yes\n"
        assert run("readlink /home/user/hello-link") == "/home/user/app/hello.txt\n"
        assert run("cat /home/user/step-cwd") == "/home/user/app\n"
        # The last WORKDIR is the sandbox's default; the start command ran at create.
        assert run("pwd") == "/home/user/app\n"
        assert run("cat /tmp/started") == "started\n"
        # ENV values are for the build only, as E2B documents.
        assert run("echo ${GREETING:-unset}") == "unset\n"
    finally:
        s.kill()

    # A bare name starts the default tag; with only `v1` built, the newest ready build.
    s = Sandbox.create(name, timeout=60)
    try:
        assert s.commands.run("cat /tmp/started").stdout == "started\n"
    finally:
        s.kill()

    # Tags: assign more, list them, start by one, remove it.
    tagged = Template.assign_tags(f"{name}:v1", ["prod", "stable"])
    assert tagged.build_id == info.build_id
    assert sorted(tagged.tags) == ["prod", "stable"]
    assert sorted(t.tag for t in Template.get_tags(name)) == ["prod", "stable", "v1"]
    s = Sandbox.create(f"{name}:prod", timeout=60)
    s.kill()
    Template.remove_tags(name, "prod")
    assert sorted(t.tag for t in Template.get_tags(name)) == ["stable", "v1"]
    with pytest.raises(Exception):
        Template.assign_tags(f"{name}:v1", ":bad")
    with pytest.raises(Exception):
        Template.assign_tags(f"{name}:v1", f"{name}:")


def test_from_template_and_a_build_in_the_background():
    base = unique("sdk-base")
    Template.build(
        Template().from_template("base").run_cmd("echo layer one > /home/user/one"),
        base,
        cpu_count=1,
        memory_mb=512,
    )
    child = unique("sdk-child")
    info = Template.build_in_background(
        Template()
        .from_template(base)
        .run_cmd("sleep 2; cat /home/user/one > /home/user/two"),
        child,
        cpu_count=1,
        memory_mb=512,
    )
    status = Template.get_build_status(info)
    assert status.status.value in ("waiting", "building")
    deadline = time.time() + 120
    offset = 0
    while True:
        st = Template.get_build_status(info, logs_offset=offset)
        offset += len(st.log_entries)
        if st.status.value in ("ready", "error") and not st.log_entries:
            break
        assert time.time() < deadline, st
        time.sleep(0.3)
    assert st.status.value == "ready", st.reason
    assert offset > 0
    s = Sandbox.create(child, timeout=60)
    try:
        assert s.commands.run("cat /home/user/two").stdout == "layer one\n"
    finally:
        s.kill()


def test_images_that_need_a_registry_and_failing_steps_raise_clearly():
    with pytest.raises(BuildException) as e:
        Template.build(
            Template().from_image("ubuntu:22.04").run_cmd("true"),
            unique("sdk-ubuntu"),
            cpu_count=1,
            memory_mb=512,
        )
    assert "cannot be pulled" in str(e.value)
    assert "e2bdev/base" in str(e.value)

    with pytest.raises(BuildException) as e:
        Template.build(
            Template().from_base_image().run_cmd("echo nope >&2; exit 7"),
            unique("sdk-fail"),
            cpu_count=1,
            memory_mb=512,
        )
    assert "exit status 7" in str(e.value)

    with pytest.raises(BuildException) as e:
        Template.build(
            Template().from_base_image().run_cmd("whoami", user="root123"),
            unique("sdk-user"),
            cpu_count=1,
            memory_mb=512,
        )
    assert "invalid username: 'root123'" in str(e.value)
    assert not Template.exists(unique("sdk-missing"))
