#!/usr/bin/env python3
"""Redis's own time per call of the token bucket script, for 1 and N buckets.

Usage: scripts/redis-script-cost.py [--keys N] [--calls C] [--batch B [--per-request | --distinct]] [--callgrind] [NAME=FILE.lua ...]

Starts its own redis-server on a free loopback port (no persistence), loads
each script (default: the request script as `script`, called with EVALSHA,
and the same text as a Redis Functions library as `library`, called with
FCALL; a NAME=FILE.lua whose text starts with `--library` is loaded as a
library too; both assembled as
src/storage/redis/script.rs does: the parts under lua/algorithms/, made on
first use, then lua/request.lua; a NAME=FILE.lua is a whole script), and sends C calls
(default 20000, pipelined 200 at a time) on hot buckets that exist, 1 key
and then N keys (default 5), each key charged 1 token of 1,000,000 per
second. It prints Redis's usec_per_call of EVALSHA or FCALL from INFO commandstats
(server time only: the client's speed does not count), and the ratio of N
keys to 1. Three reference scripts with no rate limit logic show the floor
of any script that keeps the same guarantees (every bucket read, every
charged bucket written with its own expiry): `floor-none` (returns at once),
`floor-read` (TIME and one MGET), `floor-io` (TIME, one MGET, one SET with
PX per key, a packed reply).

With --batch B (B > 1) each call carries B requests on the same buckets
(lua/request.lua, "Batch": ARGV[4], one run of B identical requests; with
--per-request, for scripts before runs, one size per request), and the
times printed are per request (usec_per_call / B); the reference scripts
are left out.

With --distinct (and --batch B), each call carries B one-descriptor
requests, each on a bucket of its own (per-user limits: nothing forms a
run; the buckets, which refill in 1 ms, are new at every call); the "N
keys" column then has N x B such requests per call, and the `go` row is
one descriptor per decision on new keys (`__rand_int__` of 1,000,000).

With --callgrind, redis-server runs under `valgrind --tool=callgrind` and
the figures are redis-server's instructions per request over the measured
calls only (command reading, the script, the reply: deterministic to about
1 %, whatever else the machine runs), not microseconds; a row `go` then
gives the Go service's command pattern on the same server, `INCRBY` +
`EXPIRE` per descriptor and decision, by `redis-benchmark` with 64 clients
and a pipeline of 2 × B commands (B decisions: its implicit pipelining
window), per decision.

The argument format is the script's own (lua/request.lua, ARGV[3]).
"""
import glob, os, socket, struct, subprocess, sys, tempfile, time

# Marks a text as a Functions library (loaded with FUNCTION LOAD, called
# with FCALL) rather than a script.
LIBRARY = "--library\n"

# Batches in the script's format of runs (ARGV[4]: charges per request and
# requests, per run); --per-request: the older format of one size per request.
RUNS = True

FLOORS = {
    "floor-none": "return 'x'",
    "floor-read": "local t = redis.call('TIME')\nlocal v = redis.call('MGET', unpack(KEYS))\nreturn 'x'",
    "floor-io": (
        "local t = redis.call('TIME')\n"
        "local now = tonumber(t[1]) * 1000000 + tonumber(t[2])\n"
        "local v = redis.call('MGET', unpack(KEYS))\n"
        "for i = 1, #KEYS do\n"
        "  redis.call('SET', KEYS[i], struct.pack('>I7I5', now, 12345678), 'PX', '100000')\n"
        "end\n"
        "return struct.pack('>BBi8', 1, 1, 5)"
    ),
}


def enc(*args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        if isinstance(a, str):
            a = a.encode()
        elif isinstance(a, int):
            a = str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


class Conn:
    def __init__(self, port):
        self.s = socket.create_connection(("127.0.0.1", port))
        self.buf = b""

    def _fill(self):
        chunk = self.s.recv(1 << 20)
        if not chunk:
            raise RuntimeError("redis-server closed the connection")
        self.buf += chunk

    def _line(self):
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def read(self):
        line = self._line()
        kind = line[:1]
        if kind in (b"+", b":"):
            return line[1:]
        if kind == b"-":
            raise RuntimeError(line.decode(errors="replace"))
        if kind == b"$":
            n = int(line[1:])
            if n < 0:
                return None
            while len(self.buf) < n + 2:
                self._fill()
            value, self.buf = self.buf[:n], self.buf[n + 2:]
            return value
        if kind == b"*":
            return [self.read() for _ in range(int(line[1:]))]
        raise RuntimeError(f"unexpected reply {line!r}")

    def cmd(self, *args):
        self.s.sendall(enc(*args))
        return self.read()

    def many(self, packed, count):
        self.s.sendall(packed * count)
        for _ in range(count):
            self.read()


def charges(n):
    # key index, R, U (s), C, cost, flags: 1,000,000 per second, cost 1.
    return b"".join(struct.pack(">IIIIQQ", i + 1, 1_000_000, 1, 1_000_000, 1, 0) for i in range(n))


# --distinct: each request of a batch on a bucket of its own.
DISTINCT = False

# Under callgrind: the redis-server process and its output file.
CALLGRIND = None


def instructions(toggle):
    """Turns callgrind's counting on or off; off returns the instructions
    counted since it was last turned on."""
    pid, out = CALLGRIND
    if toggle:
        for f in glob.glob(out + "*"):
            os.remove(f)
        subprocess.run(["callgrind_control", "-i", "on", str(pid)], stdout=subprocess.DEVNULL, check=True)
        return 0
    subprocess.run(["callgrind_control", "-i", "off", str(pid)], stdout=subprocess.DEVNULL, check=True)
    subprocess.run(["callgrind_control", "-d", str(pid)], stdout=subprocess.DEVNULL, check=True)
    total = 0
    for f in glob.glob(out + "*"):
        # (A dump's `summary:` may read 0; `totals:` has the count.)
        total += max([int(line.split()[1]) for line in open(f)
                      if line.startswith(("summary:", "totals:"))] or [0])
    return total


def go_pattern(port, nkeys, calls, batch):
    """Instructions per decision of INCRBY + EXPIRE per descriptor (with
    --distinct, on new keys: `__rand_int__` of 1,000,000)."""
    n = calls * batch
    rnd = ["-r", "1000000"] if DISTINCT else []
    instructions(True)
    for k in range(nkeys):
        key = f"go:{k}:__rand_int__" if DISTINCT else f"go:{k}"
        for cmd in (["INCRBY", key, "1"], ["EXPIRE", key, "3600"]):
            subprocess.run(["redis-benchmark", "-p", str(port), "-c", "64", "-n", str(n),
                            "-P", str(2 * batch), *rnd, "-q", *cmd],
                           stdout=subprocess.DEVNULL, check=True)
    return instructions(False) / n


def usec_per_call(conn, call, keys, calls, batch=1):
    """call: ("EVALSHA", sha) or ("FCALL", function name)."""
    if batch > 1 and DISTINCT:
        # B one-descriptor requests on B distinct buckets (runs of one).
        keys = [f"{k}:{i}" for k in keys for i in range(batch)]
        sizes = struct.pack(">II", 1, 1) * len(keys)
        packed = enc(*call, len(keys), *keys, "", "", charges(len(keys)), sizes)
        batch = len(keys)
    elif batch > 1 and RUNS:
        # One run of B identical requests (lua/request.lua, ARGV[4]).
        sizes = struct.pack(">II", len(keys), batch)
        packed = enc(*call, len(keys), *keys, "", "", charges(len(keys)), sizes)
    elif batch > 1:
        sizes = struct.pack(">I", len(keys)) * batch
        packed = enc(*call, len(keys), *keys, "", "", charges(len(keys)) * batch, sizes)
    else:
        packed = enc(*call, len(keys), *keys, "", "", charges(len(keys)))
    conn.many(packed, 2000)  # warm-up: the buckets exist from here on
    conn.cmd("CONFIG", "RESETSTAT")
    if CALLGRIND:
        instructions(True)
    for _ in range(calls // 200):
        conn.many(packed, 200)
    if CALLGRIND:
        return instructions(False) / (calls // 200 * 200) / batch
    for line in conn.cmd("INFO", "commandstats").decode().splitlines():
        if line.startswith("cmdstat_%s:" % call[0].lower()):
            return float(line.split("usec_per_call=")[1].split(",")[0]) / batch
    raise RuntimeError("no %s in INFO commandstats" % call[0])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    global CALLGRIND, RUNS, DISTINCT
    args = sys.argv[1:]
    nkeys, calls, batch, scripts = 5, 20000, 1, {}
    while args:
        a = args.pop(0)
        if a == "--keys":
            nkeys = int(args.pop(0))
        elif a == "--calls":
            calls = int(args.pop(0))
        elif a == "--batch":
            batch = int(args.pop(0))
        elif a == "--callgrind":
            CALLGRIND = True
        elif a == "--per-request":
            RUNS = False
        elif a == "--distinct":
            DISTINCT = True
        elif "=" in a:
            name, path = a.split("=", 1)
            scripts[name] = open(path).read()
        else:
            sys.exit(__doc__)
    if not scripts:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        lua = os.path.join(root, "lua")
        # The same texts as `SOURCE` and `LIBRARY` in
        # src/storage/redis/script.rs.
        parts = ["token_bucket.lua", "fixed_window.lua", "sliding_window.lua"]
        body = (
            "local function PART(a)\n"
            + "".join(
                "if a == %d then\n%s\nend\n"
                % (i, open(os.path.join(lua, "algorithms", f)).read())
                for i, f in enumerate(parts)
            )
            + "end\n"
            + "local ALGORITHMS = {}\nlocal function MAKE(a)\n"
            + "  local f = PART(a)\n  ALGORITHMS[a] = f\n  return f\nend\n"
            + "local function REQUEST(KEYS, ARGV)\n"
            + open(os.path.join(lua, "request.lua")).read()
            + "\nend\n"
        )
        scripts["script"] = body + "return REQUEST(KEYS, ARGV)\n"
        scripts["library"] = LIBRARY + body
    if batch == 1:
        scripts.update(FLOORS)
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", d]
        if CALLGRIND:
            out = os.path.join(d, "callgrind.out")
            argv = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                    f"--callgrind-out-file={out}"] + argv
        server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if CALLGRIND:
            CALLGRIND = (server.pid, out)
        unit = "in" if CALLGRIND else "us"
        try:
            for _ in range(600):
                try:
                    conn = Conn(port)
                    conn.cmd("PING")
                    break
                except OSError:
                    time.sleep(0.05)
            else:
                sys.exit("redis-server did not start")
            print(f"{'script':<12} {'1 key':>9} {str(nkeys) + ' keys':>9}  ratio")
            for name, src in scripts.items():
                if src.startswith(LIBRARY):
                    # A Functions library: loaded once, called with FCALL.
                    src = src.replace(LIBRARY, "#!lua name=cost_%s\n" % name, 1)
                    src += "redis.register_function('cost_%s', REQUEST)\n" % name
                    conn.cmd("FUNCTION", "LOAD", "REPLACE", src)
                    call = ("FCALL", "cost_%s" % name)
                else:
                    call = ("EVALSHA", conn.cmd("SCRIPT", "LOAD", src).decode())
                one = usec_per_call(conn, call, [f"cost:{name}:0"], calls, batch)
                many = usec_per_call(conn, call, [f"cost:{name}:{i}" for i in range(nkeys)], calls, batch)
                print(f"{name:<12} {one:7.2f} {unit} {many:7.2f} {unit}  {many / one:.2f}")
            if CALLGRIND:
                one = go_pattern(port, 1, calls, batch)
                # (--distinct: one descriptor per decision in both columns.)
                many = go_pattern(port, 1 if DISTINCT else nkeys, calls, batch)
                print(f"{'go':<12} {one:7.2f} in {many:7.2f} in  {many / one:.2f}")
        finally:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
