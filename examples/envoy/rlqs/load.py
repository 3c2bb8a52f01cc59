#!/usr/bin/env python3
"""Open-loop load on one or more Envoys, counting the answers.

    load.py --rate 40 --seconds 10 --header 'x-tenant: acme' http://127.0.0.1:10000/ http://127.0.0.1:10002/

Sends `--rate` requests per second to each URL (a new connection each, on
its own thread, so a slow answer never slows the schedule) for `--seconds`,
then prints one line per URL: `<url> <admitted> <denied> <other>`
(admitted = 200, denied = 429) and a last line `total <admitted> <denied>
<other>`. Standard library only.
"""

import argparse
import http.client
import threading
import time
import urllib.parse


def one(url, headers, counts, lock):
    u = urllib.parse.urlsplit(url)
    try:
        c = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
        c.request("GET", u.path or "/", headers=headers)
        status = c.getresponse().status
        c.close()
    except OSError:
        status = 0
    key = {200: 0, 429: 1}.get(status, 2)
    with lock:
        counts[key] += 1


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rate", type=float, required=True, help="requests per second per URL")
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--header", action="append", default=[], help="'name: value'")
    p.add_argument("urls", nargs="+")
    a = p.parse_args()
    headers = dict(h.split(": ", 1) for h in a.header)
    lock = threading.Lock()
    counts = {u: [0, 0, 0] for u in a.urls}
    threads = []
    start = time.monotonic()
    n = int(a.rate * a.seconds)
    for i in range(n):
        delay = start + i / a.rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        for u in a.urls:
            t = threading.Thread(target=one, args=(u, headers, counts[u], lock))
            t.start()
            threads.append(t)
    for t in threads:
        t.join()
    total = [0, 0, 0]
    for u in a.urls:
        print(u, *counts[u])
        total = [x + y for x, y in zip(total, counts[u])]
    print("total", *total)


if __name__ == "__main__":
    main()
