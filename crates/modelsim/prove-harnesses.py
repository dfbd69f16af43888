#!/usr/bin/env python3
"""Runs each coding-agent harness headless against sandpit-modelsim and checks what it did.

For pi, Claude Code, opencode (`run` and `serve`) and Codex, in a network namespace of its
own that has only loopback (so no harness can reach anything else), it:
  1. serves a script over plain HTTP: write hello.txt with "hi", run `cat hello.txt`, answer
     "done"; then checks the file, the harness's own events, the API key header the model
     saw and that every scripted turn was asked for;
  2. continues that session with a second prompt and checks the request carried the
     earlier turns (the server answers turn 3 only to a conversation holding three);
  3. serves the same over HTTPS with a test CA given through NODE_EXTRA_CA_CERTS (and,
     for Codex, SSL_CERT_FILE), and once without the CA, which must be refused.
Writes the plain-HTTP stdout (or SSE) of each harness to tests/fixtures/<harness>.jsonl with
the run's directory replaced by /proof. Needs `scripts/setup.sh --harnesses` and root (for
the namespace). Prints one line per check and `N passed, N failed` at the end.

With --strace, the first run of each harness runs under `strace -f -e trace=connect,sendto,sendmsg` and the
addresses it tried to reach other than the model server are listed (strace needed).

Usage: crates/modelsim/prove-harnesses.py [--only pi,claude,opencode,opencode-serve,codex] [--strace]
"""
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

CRATE = Path(__file__).resolve().parent
REPO = CRATE.parents[1]
BIN = REPO / ".deps/harnesses/node_modules/.bin"
FIXTURES = CRATE / "tests/fixtures"
# A fixed directory, so the fixtures can name it by one placeholder.
BASE = Path("/tmp/modelsim-proof")
KEY = "sk-modelsim-placeholder"
PROMPT = "Write hello.txt containing hi, then show it with cat."
PROMPT2 = "Are you still there?"

results = []
# Names the harnesses looked up, from the stand-in resolver (see DnsLog).
looked_up = []


def check(name, ok, detail=""):
    results.append(bool(ok))
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail and not ok else ''}", flush=True)


class DnsLog(threading.Thread):
    """A resolver on 127.0.0.1:53 that writes down each name asked and answers NXDOMAIN,
    so a run shows which hosts a harness wanted without anything leaving the namespace."""

    def __init__(self):
        super().__init__(daemon=True)
        import socket
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 53))

    def run(self):
        while True:
            data, peer = self.sock.recvfrom(4096)
            if len(data) < 12:
                continue
            labels, i = [], 12
            while i < len(data) and data[i] != 0:
                n = data[i]
                labels.append(data[i + 1:i + 1 + n].decode(errors="replace"))
                i += 1 + n
            looked_up.append(".".join(labels))
            # Same id and question, QR=1 RD=1 RA=1 RCODE=3 (NXDOMAIN), no answers.
            reply = data[:2] + b"\x81\x83" + data[4:6] + b"\x00\x00\x00\x00\x00\x00" + data[12:i + 5]
            self.sock.sendto(reply, peer)


def script(work):
    """The scripted conversation, with an alternative per harness's tool names/arguments."""
    write = [
        {"name": "write", "arguments": {"path": "hello.txt", "content": "hi\n"}},  # pi
        {"name": "write", "arguments": {"filePath": "hello.txt", "content": "hi\n"}},  # opencode
        {"name": "Write", "arguments": {"file_path": f"{work}/hello.txt", "content": "hi\n"}},  # Claude Code
        {"name": "exec_command", "arguments": {"cmd": "printf 'hi\\n' > hello.txt"}},  # Codex
    ]
    cat = [
        {"name": "bash", "arguments": {"command": "cat hello.txt"}},  # pi, opencode
        {"name": "Bash", "arguments": {"command": "cat hello.txt", "description": "Show the file"}},
        {"name": "exec_command", "arguments": {"cmd": "cat hello.txt"}},
    ]
    return {
        "turns": [
            {"text": "Writing the file.", "tool_calls": [{"any_of": write}]},
            {"tool_calls": [{"any_of": cat}]},
            {"text": "done"},
            {"text": "still here"},
        ]
    }


class ModelSim:
    """sandpit-modelsim as a child process, with its request log."""

    def __init__(self, dir, work, tls):
        dir.mkdir(parents=True, exist_ok=True)
        (dir / "script.json").write_text(json.dumps(script(work)))
        self.log = dir / "requests.jsonl"
        argv = [str(MODELSIM), "--listen", "127.0.0.1:0", "--script", str(dir / "script.json"),
                "--log", str(self.log)]
        self.ca = None
        if tls:
            argv += ["--tls-generate", str(dir), "--tls-name", "127.0.0.1", "--tls-name", "localhost"]
            self.ca = dir / "ca.pem"
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=open(dir / "modelsim.err", "w"),
                                     text=True)
        line = self.proc.stdout.readline()
        m = re.search(r"listening on (\S+)", line)
        if not m:
            raise RuntimeError(f"modelsim did not start: {line!r}")
        self.url = m.group(1)

    def requests(self):
        if not self.log.exists():
            return []
        return [json.loads(l) for l in self.log.read_text().splitlines() if l.strip()]

    def model_requests(self):
        return [r for r in self.requests() if r["api"] in ("chat_completions", "messages", "responses")]

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)


def env_base(home):
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8", "TERM": "dumb"}
    return env


# --- one function per harness: (env, argv of the first run, argv of the continue run) ---

def pi(home, url, ca):
    agent = home / "pi"
    agent.mkdir(parents=True)
    (agent / "models.json").write_text(json.dumps({"providers": {"modelsim": {
        "baseUrl": f"{url}/v1", "api": "openai-completions", "apiKey": KEY,
        "models": [{"id": "modelsim"}]}}}))
    env = env_base(home) | {"PI_CODING_AGENT_DIR": str(agent)}
    common = [str(BIN / "pi"), "--mode", "json", "--offline", "--provider", "modelsim", "--model", "modelsim"]
    return env, common + [PROMPT], lambda out: common + ["-c", PROMPT2]


def claude(home, url, ca):
    env = env_base(home) | {
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_API_KEY": KEY,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "IS_SANDBOX": "1",
    }
    common = [str(BIN / "claude"), "-p", "--output-format", "stream-json", "--verbose",
              "--include-partial-messages", "--model", "modelsim", "--dangerously-skip-permissions"]

    def resume(out):
        sid = next(e["session_id"] for e in events(out) if e.get("type") == "system")
        return common + ["--resume", sid, PROMPT2]

    return env, common + [PROMPT], resume


def opencode_env(home, url):
    config = {"$schema": "https://opencode.ai/config.json",
              "provider": {"modelsim": {"npm": "@ai-sdk/openai-compatible",
                                        "options": {"baseURL": f"{url}/v1", "apiKey": KEY},
                                        "models": {"modelsim": {}}}},
              "model": "modelsim/modelsim"}
    return env_base(home) | {
        "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local/share"),
        "XDG_CACHE_HOME": str(home / ".cache"), "XDG_STATE_HOME": str(home / ".local/state"),
        "OPENCODE_CONFIG_CONTENT": json.dumps(config),
        "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1",
    }


def opencode(home, url, ca):
    env = opencode_env(home, url)
    common = [str(BIN / "opencode"), "run", "--format", "json"]
    return env, common + [PROMPT], lambda out: common + ["--continue", PROMPT2]


def codex(home, url, ca):
    chome = home / "codex"
    chome.mkdir(parents=True)
    (chome / "config.toml").write_text(f"""model = "modelsim"
model_provider = "modelsim"
check_for_update_on_startup = false
[analytics]
enabled = false
[model_providers.modelsim]
name = "modelsim"
base_url = "{url}/v1"
env_key = "MODELSIM_API_KEY"
wire_api = "responses"
""")
    env = env_base(home) | {"CODEX_HOME": str(chome), "MODELSIM_API_KEY": KEY}
    # `exec resume` takes no -s of its own: the exec options go before it.
    common = [str(BIN / "codex"), "exec", "--json", "--skip-git-repo-check", "-s", "danger-full-access"]
    return env, common + [PROMPT], lambda out: common + ["resume", "--last", PROMPT2]


# The variables tried, one at a time, to hand a harness the test CA.
CA_VARS = {"codex": ["NODE_EXTRA_CA_CERTS", "SSL_CERT_FILE", "CODEX_CA_CERTIFICATE"]}

HARNESSES = {"pi": pi, "claude": claude, "opencode": opencode, "codex": codex}

# What each harness's own stream must show for the run to count.
def events(text):
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def stream_ok(name, out):
    ev = events(out)
    types = [e.get("type") for e in ev]
    if name == "pi":
        ends = [e for e in ev if e.get("type") == "tool_execution_end" and e.get("toolName") == "bash"]
        return "agent_end" in types and ends and "hi" in json.dumps(ends[0]["result"])
    if name == "claude":
        res = [e for e in ev if e.get("type") == "result"]
        return ("stream_event" in types and res and res[-1].get("subtype") == "success"
                and res[-1].get("result") == "done")
    if name == "opencode":
        tools = [e for e in ev if e.get("type") == "tool_use" and e["part"].get("tool") == "bash"]
        texts = [e["part"]["text"] for e in ev if e.get("type") == "text"]
        return tools and tools[0]["part"]["state"].get("output") == "hi\n" and "done" in texts
    if name == "codex":
        cmds = [e["item"] for e in ev if e.get("type") == "item.completed"
                and e["item"].get("type") == "command_execution"]
        msgs = [e["item"].get("text") for e in ev if e.get("type") == "item.completed"
                and e["item"].get("type") == "agent_message"]
        return "turn.completed" in types and any("hi" in (c.get("aggregated_output") or "") for c in cmds) and "done" in msgs
    return False


def run(argv, env, cwd, timeout):
    try:
        p = subprocess.run(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=timeout)
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        return "timeout", (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), ""


def key_headers(reqs):
    seen = set()
    for r in reqs:
        h = r["headers"]
        if h.get("x-api-key") == KEY:
            seen.add("x-api-key")
        if h.get("authorization") == f"Bearer {KEY}":
            seen.add("authorization: Bearer")
    return sorted(seen)


def sanitize(text):
    text = text.replace(str(BASE), "/proof").replace(str(BASE).lstrip("/"), "proof")
    return text.replace(str(BASE).replace("/", "-").replace(".", "-"), "-proof")


def fresh(name, mode):
    d = BASE / f"{name}-{mode}"
    shutil.rmtree(d, ignore_errors=True)
    (d / "work").mkdir(parents=True)
    (d / "home").mkdir()
    return d, d / "work", d / "home"


def prove_cli(name):
    # 1. plain HTTP, then continue the session.
    d, work, home = fresh(name, "http")
    sim = ModelSim(d / "sim", work, tls=False)
    env, argv, again = HARNESSES[name](home, sim.url, None)
    trace = d / "connect.strace"
    if STRACE:
        argv = ["strace", "-f", "-qq", "-e", "trace=connect,sendto,sendmsg", "-o", str(trace)] + argv
    t = time.monotonic()
    rc, out, err = run(argv, env, work, 180)
    names = sorted(set(looked_up))
    looked_up.clear()
    print(f"INFO {name}: names looked up during the run: {names or 'none'}", flush=True)
    if STRACE:
        port = sim.url.rsplit(":", 1)[1]
        tried = set()
        for line in trace.read_text().splitlines():
            port_m = re.search(r"sin6?_port=htons\((\d+)\)", line)
            addr_m = re.search(r'inet_addr\("([^"]+)"\)|inet_pton\(AF_INET6, "([^"]+)"', line)
            if port_m and addr_m:
                addr = f"{addr_m.group(1) or addr_m.group(2)}:{port_m.group(1)}"
                # The model server and the stand-in resolver are ours.
                if addr not in (f"127.0.0.1:{port}", "127.0.0.1:53"):
                    tried.add(addr)
        print(f"INFO {name}: addresses tried other than the model server: {sorted(tried) or 'none'}", flush=True)
    took = time.monotonic() - t
    (d / "stdout.jsonl").write_text(out)
    (d / "stderr.txt").write_text(err)
    hello = work / "hello.txt"
    check(f"{name} http: exit 0 ({took:.1f}s)", rc == 0, f"rc={rc} stderr={err[-500:]}")
    check(f"{name} http: hello.txt says hi", hello.exists() and hello.read_text() == "hi\n")
    check(f"{name} http: its stream shows the tool results and the final answer", stream_ok(name, out))
    reqs = sim.model_requests()
    turns = sorted({r["turn"] for r in reqs if r["turn"] is not None})
    check(f"{name} http: the model was asked turns 0, 1, 2 and no request missed the script",
          turns == [0, 1, 2] and not any(r["note"] for r in reqs), f"turns={turns} notes={[r['note'] for r in reqs if r['note']]}")
    heads = key_headers(reqs)
    print(f"INFO {name}: key header {heads}; paths {sorted({r['path'] + ('?' + r['query'] if r['query'] else '') for r in sim.requests()})}; "
          f"side requests {sum(r['side'] for r in reqs)}; stream {sorted({r['stream'] for r in reqs})}")
    check(f"{name} http: every model request carried the key", heads and all(
        r["headers"].get("x-api-key") == KEY or r["headers"].get("authorization") == f"Bearer {KEY}" for r in reqs))
    (FIXTURES / f"{name}.jsonl").write_text(sanitize(out))
    rc, out2, err2 = run(again(out), env, work, 180)
    (d / "stdout-continue.jsonl").write_text(out2)
    later = [r for r in sim.model_requests() if r["turn"] == 3]
    carried = later and "Writing the file." in json.dumps(later[0]["body"])
    check(f"{name} continue: exit 0 and the request held the earlier turns", rc == 0 and carried,
          f"rc={rc} turns={[r['turn'] for r in sim.model_requests()]} stderr={err2[-300:]}")
    sim.stop()
    # 2. HTTPS with the test CA named by each variable the harness might read, then none.
    trusted = []
    for var in CA_VARS.get(name, ["NODE_EXTRA_CA_CERTS"]) + [None]:
        mode = f"https-{var or 'noca'}"
        d, work, home = fresh(name, mode)
        sim = ModelSim(d / "sim", work, tls=True)
        env, argv, _ = HARNESSES[name](home, sim.url, sim.ca)
        if var:
            env[var] = str(sim.ca)
        rc, out, err = run(argv, env, work, 90 if var else 40)
        (d / "stdout.jsonl").write_text(out)
        (d / "stderr.txt").write_text(err)
        ok = rc == 0 and (work / "hello.txt").exists() and len(sim.model_requests()) >= 3
        if var:
            print(f"INFO {name} https with {var}: {'completes' if ok else 'fails'}"
                  f" (rc={rc}, model requests {len(sim.model_requests())})", flush=True)
            if ok:
                trusted.append(var)
        else:
            check(f"{name} https without the CA: no request gets through", not sim.model_requests(),
                  f"requests={len(sim.model_requests())}")
        sim.stop()
    check(f"{name} https: completes when the test CA is given by {trusted}", trusted)


def prove_opencode_serve():
    name = "opencode-serve"
    d, work, home = fresh(name, "http")
    sim = ModelSim(d / "sim", work, tls=False)
    env = opencode_env(home, sim.url)
    serve = subprocess.Popen([str(BIN / "opencode"), "serve", "--hostname", "127.0.0.1", "--port", "0"],
                             env=env, cwd=work, stdout=subprocess.PIPE, stderr=open(d / "stderr.txt", "w"),
                             text=True)
    try:
        url = None
        for _ in range(20):
            line = serve.stdout.readline()
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                url = m.group(1)
                break
        check(f"{name}: the server starts", url is not None)
        if url is None:
            return
        lines = []
        idle = threading.Event()

        def follow():
            with urllib.request.urlopen(f"{url}/event", timeout=300) as resp:
                for raw in resp:
                    raw = raw.decode().rstrip("\n")
                    if raw.startswith("data: "):
                        lines.append(raw[6:])
                        if '"session.idle"' in raw:
                            idle.set()

        threading.Thread(target=follow, daemon=True).start()
        time.sleep(0.5)

        def post(path, body):
            req = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(), method="POST",
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                text = resp.read().decode()
                return json.loads(text) if text else None

        sid = post("/session", {})["id"]
        post(f"/session/{sid}/prompt_async", {"parts": [{"type": "text", "text": PROMPT}]})
        check(f"{name}: the session goes idle", idle.wait(120))
        hello = work / "hello.txt"
        check(f"{name}: hello.txt says hi", hello.exists() and hello.read_text() == "hi\n")
        evs = [json.loads(l) for l in lines]
        tool_done = [e for e in evs if e.get("type") == "message.part.updated"
                     and e["properties"]["part"].get("tool") == "bash"
                     and e["properties"]["part"]["state"].get("status") == "completed"]
        deltas = [e for e in evs if e.get("type") == "message.part.delta"]
        check(f"{name}: the SSE stream shows text deltas and the bash result",
              deltas and tool_done and tool_done[-1]["properties"]["part"]["state"]["output"] == "hi\n")
        reqs = sim.model_requests()
        turns = sorted({r["turn"] for r in reqs if r["turn"] is not None})
        check(f"{name}: the model was asked turns 0, 1, 2", turns == [0, 1, 2], f"turns={turns}")
        (FIXTURES / f"{name}.jsonl").write_text(sanitize("\n".join(lines) + "\n"))
        idle.clear()
        post(f"/session/{sid}/prompt_async", {"parts": [{"type": "text", "text": PROMPT2}]})
        idle.wait(120)
        later = [r for r in sim.model_requests() if r["turn"] == 3]
        check(f"{name}: a second prompt in the session carries the earlier turns",
              later and "Writing the file." in json.dumps(later[0]["body"]))
    finally:
        serve.terminate()
        serve.wait(10)
        sim.stop()


def main():
    global STRACE
    STRACE = "--strace" in sys.argv
    only = None
    if "--only" in sys.argv:
        only = sys.argv[sys.argv.index("--only") + 1].split(",")
    if os.environ.get("MODELSIM_PROOF_NETNS") != "1":
        subprocess.run(["cargo", "build", "-q", "-p", "sandpit-modelsim"], cwd=REPO, check=True)
        # Only loopback inside: whatever else a harness tries to reach fails at once. A
        # mount namespace of its own lets the resolver be the stand-in on loopback.
        os.execvp("unshare", ["unshare", "--net", "--mount", "env", "MODELSIM_PROOF_NETNS=1",
                              sys.executable] + sys.argv)
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    BASE.mkdir(parents=True, exist_ok=True)
    (BASE / "resolv.conf").write_text("nameserver 127.0.0.1\n")
    subprocess.run(["mount", "--bind", str(BASE / "resolv.conf"), "/etc/resolv.conf"], check=True)
    DnsLog().start()
    global MODELSIM
    MODELSIM = REPO / "target/x86_64-unknown-linux-gnu/debug/sandpit-modelsim"
    if not MODELSIM.exists():
        MODELSIM = REPO / "target/debug/sandpit-modelsim"
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name in ["pi", "claude", "opencode", "codex"]:
        if only is None or name in only:
            if not (BIN / name).exists():
                check(f"{name}: installed (scripts/setup.sh --harnesses)", False)
                continue
            prove_cli(name)
    if only is None or "opencode-serve" in only:
        prove_opencode_serve()
    passed = sum(results)
    print(f"{passed} passed, {len(results) - passed} failed")
    sys.exit(0 if passed == len(results) else 1)


if __name__ == "__main__":
    main()
