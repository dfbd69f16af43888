"""E2B's Python SDK (e2b 2.63.0), unmodified, in the host form: every sandbox port is
`https://{port}-{id}.{domain}`, as against E2B's cloud.

Two ways to run, picked by the environment:
- host form (the Rust test `e2b_host_tls`): E2B_DOMAIN and an https E2B_API_URL, no
  E2B_SANDBOX_URL; the daemon serves TLS with a certificate from `sandpit tls init`, the
  names under the domain resolve to 127.0.0.1 through a DNS stub of the test's and
  SSL_CERT_FILE trusts the test's CA;
- the E2B_SANDBOX_URL form (the Rust test `e2b_sdk`, with the other scenarios): the one
  thing checked is that a signed download URL, which in that form names no sandbox,
  fails with an answer that says how to fix it.
"""

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request

import httpx
import pytest
from e2b import Sandbox

HOST_FORM = not os.environ.get("E2B_SANDBOX_URL")


def fetch(url, method="GET", data=None, headers=None):
    """(status, body) of a request with the standard library (as the E2B suite does)."""
    req = urllib.request.Request(url, method=method, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def with_host(url, host_label):
    """`url` with the first label of its host replaced (another sandbox's name)."""
    u = urllib.parse.urlsplit(url)
    rest = u.netloc.split(".", 1)[1]
    return urllib.parse.urlunsplit(u._replace(netloc=f"{host_label}.{rest}"))


def with_query(url, **changes):
    u = urllib.parse.urlsplit(url)
    q = dict(urllib.parse.parse_qsl(u.query))
    q.update(changes)
    return urllib.parse.urlunsplit(
        u._replace(query=urllib.parse.urlencode(q, quote_via=urllib.parse.quote))
    )


if HOST_FORM:
    DOMAIN = os.environ["E2B_DOMAIN"]

    @pytest.fixture
    def sbx():
        s = Sandbox.create(timeout=300)
        yield s
        s.kill()

    def wait_for_port(url, headers=None):
        last = None
        for _ in range(60):
            try:
                last = httpx.get(url, headers=headers or {}, timeout=5)
                if last.status_code == 200:
                    return last
            except httpx.TransportError as e:
                last = e
            time.sleep(0.25)
        raise AssertionError(f"{url} never answered 200: {last!r}")

    def test_envd_is_reached_by_host_name_over_tls(sbx):
        # The SDK's own envd calls (commands, files) go to https://49983-{id}.{domain}.
        assert sbx.envd_api_url == f"https://49983-{sbx.sandbox_id}.{DOMAIN}"
        assert sbx.commands.run("echo hello").stdout == "hello\n"
        sbx.files.write("/home/user/notes/a.txt", "written over TLS")
        assert sbx.files.read("/home/user/notes/a.txt") == "written over TLS"
        names = [e.name for e in sbx.files.list("/home/user/notes")]
        assert names == ["a.txt"]

    def test_get_host_reaches_a_server_in_the_sandbox(sbx):
        sbx.files.write("/home/user/site/index.html", "<p>served from the sandbox</p>")
        server = sbx.commands.run(
            "cd /home/user/site && exec python3 -m http.server 8000", background=True
        )
        try:
            host = sbx.get_host(8000)
            assert host == f"8000-{sbx.sandbox_id}.{DOMAIN}"
            r = wait_for_port(f"https://{host}/index.html")
            assert r.text == "<p>served from the sandbox</p>"
            assert r.url.scheme == "https"
            # A connection opened for this sandbox's name cannot carry a request for
            # another sandbox's (the SNI is this host, the Host header another): 421.
            other = f"8000-{'z' * 20}.{DOMAIN}"
            r = httpx.get(f"https://{host}/index.html", headers={"Host": other})
            assert r.status_code == 421, r.text
            # Nor can the E2B headers redirect it to another sandbox's port.
            r = httpx.get(
                f"https://{host}/index.html",
                headers={"E2b-Sandbox-Id": "z" * 20, "E2b-Sandbox-Port": "8000"},
            )
            assert r.status_code == 421, r.text
        finally:
            server.kill()

    def test_private_ports_need_the_traffic_token():
        s = Sandbox.create(timeout=300, network={"allow_public_traffic": False})
        try:
            assert s.traffic_access_token
            s.files.write("/home/user/p/x", "private")
            server = s.commands.run(
                "cd /home/user/p && exec python3 -m http.server 8001", background=True
            )
            url = f"https://{s.get_host(8001)}/x"
            r = wait_for_port(url, {"E2B-Traffic-Access-Token": s.traffic_access_token})
            assert r.text == "private"
            assert httpx.get(url).status_code == 401
            bad = {"E2B-Traffic-Access-Token": "x" + s.traffic_access_token[1:]}
            assert httpx.get(url, headers=bad).status_code == 403
            server.kill()
        finally:
            s.kill()

    def test_signed_download_and_upload_urls(sbx):
        sbx.files.write("/home/user/data.txt", "signed content")
        url = sbx.download_url("/home/user/data.txt", "user")
        assert url.startswith(f"https://49983-{sbx.sandbox_id}.{DOMAIN}/files?")
        assert "signature=" in url
        assert fetch(url) == (200, b"signed content")

        expiring = sbx.download_url(
            "/home/user/data.txt", "user", use_signature_expiration=120
        )
        assert fetch(expiring) == (200, b"signed content")
        expired = sbx.download_url(
            "/home/user/data.txt", "user", use_signature_expiration=-120
        )
        status, body = fetch(expired)
        assert status == 401
        assert json.loads(body) == {"code": 401, "message": "signature is already expired"}

        up = sbx.upload_url("/home/user/uploaded.bin", "user")
        payload = bytes(range(256)) * 4
        r = httpx.post(up, files={"file": ("uploaded.bin", payload)})
        assert r.status_code == 200, r.text
        assert sbx.files.read("/home/user/uploaded.bin", format="bytes") == payload

    def test_a_signed_url_is_for_one_sandbox_path_and_operation(sbx):
        other = Sandbox.create(timeout=300)
        try:
            for s in (sbx, other):
                s.files.write("/home/user/secret.txt", f"of {s.sandbox_id}")
                s.files.write("/home/user/other.txt", "another file")
            url = sbx.download_url("/home/user/secret.txt", "user", 300)
            assert fetch(url) == (200, f"of {sbx.sandbox_id}".encode())
            invalid = {"code": 401, "message": "invalid signature"}
            # The same URL under the other sandbox's name: its token signs differently.
            moved = with_host(url, f"49983-{other.sandbox_id}")
            status, body = fetch(moved)
            assert (status, json.loads(body)) == (401, invalid)
            # Another path, another user, a later expiry, or a read signature used to
            # write: each breaks the signature.
            for changed in (
                with_query(url, path="/home/user/other.txt"),
                with_query(url, username="root"),
                with_query(url, signature_expiration=str(int(time.time()) + 9999)),
            ):
                status, body = fetch(changed)
                assert (status, json.loads(body)) == (401, invalid), changed
            status, _ = fetch(url, method="POST", data=b"x")
            assert status == 401
            # Unsigned, a secure sandbox's files are not served at all.
            unsigned = with_query(url, signature="")
            assert fetch(unsigned)[0] in (401, 403)
        finally:
            other.kill()

else:

    def test_download_url_without_a_domain_names_the_fix():
        # E2B_SANDBOX_URL is one address for every sandbox: the SDK's signed URL is
        # E2B_SANDBOX_URL/files?..., with no sandbox in it. The daemon says what to do.
        s = Sandbox.create(timeout=120, secure=True)
        try:
            s.files.write("/home/user/f.txt", "x")
            url = s.download_url("/home/user/f.txt")
            assert url.startswith(os.environ["E2B_SANDBOX_URL"].rstrip("/") + "/files?")
            status, body = fetch(url)
            assert status == 400
            message = json.loads(body)["message"]
            assert "E2B_SANDBOX_URL" in message and "E2B_DOMAIN" in message
            assert "sandpit tls init" in message
        finally:
            s.kill()
