#!/usr/bin/env python3
"""Memory under the connection attacks the service must bound: runs one attack
against a running bucket-rls and prints the server's RSS before, at its peak
during the attack, and after the attack's connections are closed.

Usage (the server's pid is read for /proc/<pid>/status):

    .venv/bin/python scripts/attack-rss.py --pid PID --grpc 127.0.0.1:8081 \
        --http 127.0.0.1:8080 ATTACK [--conns N] [--streams N] [--hold SECS]

Attacks (each holds its connections for --hold seconds, then closes them):

  get-streams        one connection per --conns, --streams GET streams on the
                     ShouldRateLimit path, each declaring a 2 MiB message and
                     sending all of it but the last byte
  unfinished-bodies  the same with POST (the gRPC method itself)
  no-window          connections that advertise a zero stream window and open
                     --streams valid calls each, never reading an answer
  reflection         one reflection stream per connection asking for every
                     file of the service, never reading an answer
  admin-bodies       admin-port requests (HTTP/1.1 POST /json) declaring a
                     2 MiB body and sending 16 KiB, never finishing
  dribble-head       admin-port request heads sent one byte per second

It needs the `h2` package (scripts/requirements.txt installs it in .venv).
The result line is machine-readable:
    attack=NAME conns=N streams=N rss_before_kib=.. rss_peak_kib=.. rss_after_kib=.. open_at_end=N
"""

import argparse
import socket
import struct
import sys
import threading
import time

import h2.config
import h2.connection
import h2.events
import h2.settings

RLS_PATH = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
REFLECTION_PATH = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
TWO_MIB = 2 << 20


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def addr(text):
    host, port = text.rsplit(":", 1)
    if not host.startswith("127."):
        raise SystemExit(f"refusing {text}: attacks target loopback only")
    return host, int(port)


def rls_message(domain, key, value):
    """A RateLimitRequest with one descriptor of one entry, gRPC framed."""

    def field(no, payload):
        return bytes([(no << 3) | 2]) + varint(len(payload)) + payload

    entry = field(1, key.encode()) + field(2, value.encode())
    descriptor = field(1, entry)
    msg = field(1, domain.encode()) + field(2, descriptor)
    return b"\x00" + struct.pack(">I", len(msg)) + msg


def reflection_message():
    """ServerReflectionRequest{list_services: ""}: small, answered with
    every service name, then file requests are not needed for the attack:
    the answer is what sits unread."""
    msg = bytes([(7 << 3) | 2, 0])
    return b"\x00" + struct.pack(">I", len(msg)) + msg


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


class H2Conn:
    """One client HTTP/2 connection driven by hand."""

    def __init__(self, target, window=None):
        self.sock = socket.create_connection(target, timeout=10)
        cfg = h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        self.conn = h2.connection.H2Connection(config=cfg)
        self.conn.initiate_connection()
        if window is not None:
            self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.flush()
        # Stream id -> bytes still to send (the last byte of each body is
        # never sent).
        self.pending = {}

    def flush(self):
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def open(self, method, path, body_prefix, end):
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(
            sid,
            [
                (":method", method),
                (":scheme", "http"),
                (":authority", "attack"),
                (":path", path),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            ],
        )
        if end:
            self.conn.send_data(sid, body_prefix, end_stream=True)
        elif body_prefix:
            self.pending[sid] = body_prefix
            self.feed()
        self.flush()
        return sid

    def feed(self):
        """Sends what the peer's windows allow of the unfinished bodies."""
        for sid, rest in list(self.pending.items()):
            while rest:
                try:
                    room = min(
                        len(rest),
                        self.conn.local_flow_control_window(sid),
                        self.conn.max_outbound_frame_size,
                    )
                except Exception:
                    rest = b""
                    break
                if room <= 0:
                    break
                try:
                    self.conn.send_data(sid, rest[:room])
                except Exception:
                    # The server ended the stream (refused or reset it).
                    rest = b""
                    break
                rest = rest[room:]
            if rest:
                self.pending[sid] = rest
            else:
                del self.pending[sid]

    def pump(self, duration):
        """Reads (and answers pings/settings) without granting any window."""
        self.sock.settimeout(0.2)
        end = time.time() + duration
        while time.time() < end:
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                return False
            if not data:
                return False
            try:
                self.conn.receive_data(data)
            except Exception:
                return False
            self.feed()
            self.flush()
        return True

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


def attack_streams(args, method, path, body):
    conns = []
    for _ in range(args.conns):
        c = H2Conn(args.grpc, window=0 if args.attack == "no-window" else None)
        # Let the server's settings arrive (stream limit, window).
        c.pump(0.05)
        for _ in range(args.streams):
            try:
                c.open(method, path, body, end=args.attack in ("no-window", "reflection"))
            except Exception:
                break
        conns.append(c)
    return conns


def declared_prefix():
    # A 5-byte gRPC prefix declaring 2 MiB, then all of the body but its
    # last byte, sent as the server's windows allow.
    return b"\x00" + struct.pack(">I", TWO_MIB) + b"\x00" * (TWO_MIB - 1)


def attack_admin(args, dribble):
    socks = []
    for _ in range(args.conns):
        try:
            s = socket.create_connection(args.http, timeout=10)
        except OSError:
            break
        if dribble:
            s.sendall(b"P")
        else:
            s.sendall(
                f"POST /json HTTP/1.1\r\nHost: attack\r\nContent-Type: application/json\r\n"
                f"Content-Length: {TWO_MIB}\r\n\r\n".encode()
                + b" " * (16 << 10)
            )
        socks.append(s)
    return socks


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("attack", choices=["get-streams", "unfinished-bodies", "no-window", "reflection", "admin-bodies", "dribble-head"])
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--grpc", type=addr, default=("127.0.0.1", 8081))
    p.add_argument("--http", type=addr, default=("127.0.0.1", 8080))
    p.add_argument("--conns", type=int, default=16)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--hold", type=float, default=15.0)
    args = p.parse_args()

    before = rss_kib(args.pid)
    peak = [before]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], rss_kib(args.pid))
            except (OSError, RuntimeError):
                return
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    if args.attack == "get-streams":
        held = attack_streams(args, "GET", RLS_PATH, declared_prefix())
    elif args.attack == "unfinished-bodies":
        held = attack_streams(args, "POST", RLS_PATH, declared_prefix())
    elif args.attack == "no-window":
        held = attack_streams(args, "POST", RLS_PATH, rls_message("attack", "k", "v"))
    elif args.attack == "reflection":
        held = attack_streams(args, "POST", REFLECTION_PATH, reflection_message())
    else:
        held = attack_admin(args, dribble=args.attack == "dribble-head")

    open_at_end = len(held)
    if args.attack in ("admin-bodies", "dribble-head"):
        end = time.time() + args.hold
        while time.time() < end:
            time.sleep(1)
            if args.attack == "dribble-head":
                for s in list(held):
                    try:
                        s.sendall(b"O")
                    except OSError:
                        held.remove(s)
        open_at_end = 0
        for s in held:
            try:
                s.setblocking(False)
                alive = s.recv(1) != b""
            except BlockingIOError:
                alive = True
            except OSError:
                alive = False
            open_at_end += alive
            s.close()
    else:
        # Every connection is pumped in turn for the hold time (settings and
        # pings answered, no window granted, nothing read by the caller).
        end = time.time() + args.hold
        alive = list(held)
        while time.time() < end and alive:
            alive = [c for c in alive if c.pump(0.05)]
        open_at_end = len(alive)
        for c in held:
            c.close()

    time.sleep(3)
    stop.set()
    sampler.join()
    after = rss_kib(args.pid)
    print(
        f"attack={args.attack} conns={args.conns} streams={args.streams} "
        f"rss_before_kib={before} rss_peak_kib={peak[0]} rss_after_kib={after} open_at_end={open_at_end}"
    )


if __name__ == "__main__":
    sys.exit(main())
