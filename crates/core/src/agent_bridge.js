// sandpit's bridge to a harness that serves HTTP + SSE (opencode `serve`), run by node
// inside the sandbox. It turns that server into what the daemon drives for every other
// harness: events as JSON lines on stdout, requests as JSON lines on stdin.
//
// The launch is in SANDPIT_BRIDGE: {argv, port, path, ready, steps, session}. The bridge
// starts argv, waits for `ready` on its stdout, subscribes to GET `path`, then makes the
// steps' requests in order ({method, path, body, session_from}; `{session}` in a path is
// the session id). A session id it learns is printed as {"type":"sandpit.session","id"}.
// Every SSE event's data is printed as one line. Each stdin line is one more request (the
// abort); the end of stdin stops the server and the bridge. Its own messages go to stderr.
"use strict";
const { spawn } = require("node:child_process");
const readline = require("node:readline");

const cfg = JSON.parse(process.env.SANDPIT_BRIDGE || "{}");
delete process.env.SANDPIT_BRIDGE;
const base = `http://127.0.0.1:${cfg.port}`;
let session = cfg.session || null;

function out(obj) {
  process.stdout.write(JSON.stringify(obj) + "\n");
}

function pointer(v, p) {
  for (const k of (p || "").split("/").slice(1)) {
    if (v == null) return undefined;
    v = v[k.replace(/~1/g, "/").replace(/~0/g, "~")];
  }
  return v;
}

const child = spawn(cfg.argv[0], cfg.argv.slice(1), { stdio: ["ignore", "pipe", "inherit"] });
child.on("exit", (code, signal) => {
  process.stderr.write(`bridge: server exited (${code ?? signal})\n`);
  process.exit(code ?? 1);
});
function stop() {
  child.kill("SIGTERM");
  setTimeout(() => child.kill("SIGKILL"), 2000).unref();
}
process.on("SIGTERM", stop);

async function call(step) {
  const path = step.path.split("{session}").join(session || "");
  // A server still starting may leave a request hanging: short timeouts, a few tries.
  for (let attempt = 0; ; attempt++) {
    try {
      const res = await fetch(base + path, {
        method: step.method,
        headers: { "content-type": "application/json" },
        body: step.body == null ? undefined : JSON.stringify(step.body),
        signal: AbortSignal.timeout(10000),
      });
      const text = await res.text();
      if (!res.ok) throw new Error(`${step.method} ${path}: ${res.status} ${text.slice(0, 200)}`);
      if (step.session_from) {
        const id = pointer(text ? JSON.parse(text) : null, step.session_from);
        if (typeof id !== "string") throw new Error(`${path}: no session id`);
        session = id;
        out({ type: "sandpit.session", id });
      }
      return;
    } catch (e) {
      if (attempt >= 4) throw e;
      await new Promise((r) => setTimeout(r, 500));
    }
  }
}

async function subscribe() {
  const res = await fetch(base + cfg.path, { headers: { accept: "text/event-stream" } });
  if (!res.ok) throw new Error(`GET ${cfg.path}: ${res.status}`);
  const decoder = new TextDecoder();
  let buf = "";
  (async () => {
    for await (const chunk of res.body) {
      buf += decoder.decode(chunk, { stream: true }).replace(/\r\n/g, "\n");
      let end;
      while ((end = buf.indexOf("\n\n")) >= 0) {
        const ev = buf.slice(0, end);
        buf = buf.slice(end + 2);
        const data = ev
          .split("\n")
          .filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, ""))
          .join("\n");
        if (!data) continue;
        try {
          out(JSON.parse(data));
        } catch {
          process.stderr.write(`bridge: event that is not JSON: ${data.slice(0, 200)}\n`);
        }
      }
    }
    process.stderr.write("bridge: the event stream ended\n");
    stop();
  })().catch((e) => {
    process.stderr.write(`bridge: event stream: ${e}\n`);
    stop();
  });
}

async function main() {
  const rl = readline.createInterface({ input: child.stdout });
  await new Promise((resolve) => {
    rl.on("line", (line) => {
      process.stderr.write(`server: ${line}\n`);
      if (line.includes(cfg.ready)) resolve();
    });
  });
  await subscribe();
  for (const step of cfg.steps) await call(step);
  const input = readline.createInterface({ input: process.stdin });
  input.on("line", (line) => {
    if (!line.trim()) return;
    call(JSON.parse(line)).catch((e) => process.stderr.write(`bridge: ${e}\n`));
  });
  input.on("close", stop);
}

main().catch((e) => {
  process.stderr.write(`bridge: ${e && e.stack ? e.stack : e}\n`);
  stop();
  setTimeout(() => process.exit(1), 2500).unref();
});
