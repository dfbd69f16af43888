"""Test servers of a network namespace the tests make: DNS (UDP 53), HTTP (80), HTTPS (443,
any name, a certificate of a test CA), and a server-first TCP banner (7000). Only ever bound inside that
namespace. Usage: upstream.py CONFIG_JSON ("dns": {name: address}, "dns_ip", "cert", "key",
"requests": a file that gets one JSON line per HTTP request answered, with the address it
came to as "local"; "dns_file": {name: [address, ttl]} read at every query, over "dns").
Questions for names under `blackhole.test` are swallowed: a zone whose name server never
answers."""

import json
import socket
import ssl
import struct
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

cfg = json.loads(sys.argv[1])
names = {k.lower().rstrip("."): v for k, v in cfg["dns"].items()}


def dns_reply(q):
    if len(q) < 12:
        return None
    tid, flags, qd = struct.unpack("!HHH", q[:6])
    if qd != 1:
        return None
    i, labels = 12, []
    while i < len(q) and q[i] != 0:
        n = q[i]
        labels.append(q[i + 1 : i + 1 + n].decode("ascii", "replace"))
        i += 1 + n
    qend = i + 5
    qtype = struct.unpack("!H", q[i + 1 : i + 3])[0]
    name = ".".join(labels).lower()
    question = q[12:qend]
    if name == "blackhole.test" or name.endswith(".blackhole.test"):
        return None
    addr, ttl = names.get(name), 30
    try:
        with open(cfg["dns_file"]) as f:
            changed = json.load(f)
    except (OSError, ValueError):
        changed = {}
    if name in changed:
        addr, ttl = changed[name]
    rd = flags & 0x0100
    if addr is None:
        return struct.pack("!HHHHHH", tid, 0x8183 | rd, 1, 0, 0, 0) + question
    answers = b""
    count = 0
    if qtype == 1:
        answers = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, ttl, 4) + socket.inet_aton(addr)
        count = 1
    return struct.pack("!HHHHHH", tid, 0x8180 | rd, 1, count, 0, 0) + question + answers


def dns():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((cfg["dns_ip"], 53))
    while True:
        q, peer = s.recvfrom(4096)
        try:
            r = dns_reply(q)
        except Exception:
            r = None
        if r:
            s.sendto(r, peer)


log_lock = threading.Lock()


def record(h):
    """Appends what a request came with, before it is answered: the tests read the
    Authorization header here, since the broker masks it in any echo."""
    line = json.dumps(
        {
            "host": h.headers.get("Host", ""),
            "method": h.command,
            "path": h.path,
            "authorization": h.headers.get("Authorization"),
            "local": h.connection.getsockname()[0],
            "headers": [[k, v] for k, v in h.headers.items()],
        }
    )
    with log_lock, open(cfg["requests"], "a") as f:
        f.write(line + "\n")


class Hello(BaseHTTPRequestHandler):
    # Keep-alive, as most real servers: every answer has a Content-Length.
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        record(self)
        host = self.headers.get("Host", "")
        sni = getattr(self.connection, "sni", None)
        body = json.dumps(
            {
                "host": host,
                "sni": sni,
                "local": self.connection.getsockname()[0],
                "path": self.path,
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_DELETE(self):
        self.do_GET()

    def do_POST(self):
        record(self)
        n = int(self.headers.get("Content-Length", "0"))
        left = n
        while left > 0:
            got = self.rfile.read(min(left, 65536))
            if not got:
                break
            left -= len(got)
        body = json.dumps({"received": n - left}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


class TlsServer(ThreadingHTTPServer):
    def __init__(self, addr, handler, ctx):
        super().__init__(addr, handler)
        self.ctx = ctx

    def get_request(self):
        sock, addr = self.socket.accept()
        holder = {}

        def on_sni(conn, name, _ctx):
            holder["sni"] = name

        self.ctx.sni_callback = on_sni
        tls = self.ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        try:
            tls.settimeout(5)
            tls.do_handshake()
            tls.settimeout(None)
        except Exception:
            sock.close()
            raise OSError("handshake failed")
        tls.sni = holder.get("sni")
        return tls, addr


def banner():
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 7000))
    s.listen(64)
    while True:
        c, _ = s.accept()
        try:
            c.sendall(b"BANNER " + c.getsockname()[0].encode() + b"\n")
        finally:
            c.close()


ThreadingHTTPServer.allow_reuse_address = True
threading.Thread(target=dns, daemon=True).start()
threading.Thread(target=banner, daemon=True).start()
http = ThreadingHTTPServer(("0.0.0.0", 80), Hello)
threading.Thread(target=http.serve_forever, daemon=True).start()
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cfg["cert"], cfg["key"])
tls = TlsServer(("0.0.0.0", 443), Hello, ctx)
threading.Thread(target=tls.serve_forever, daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
