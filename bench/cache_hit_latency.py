#!/usr/bin/env python3
"""Latency of deterministic-cache hits through a running ctxproxy, against the upstream path.

    python3 bench/cache_hit_latency.py http://127.0.0.1:8080 [N]

Sends one temperature-0 question until it is a hit (X-Ctxproxy-Cache: hit), then N sequential
requests on one keep-alive connection, and min(N, 200) with `Cache-Control: no-cache` (no
lookup, upstream called). Prints p50/p90/p99/max in milliseconds, measured by this client (the client's
own overhead is included in both).
"""
import http.client
import json
import sys
import time
from urllib.parse import urlparse

url = urlparse(sys.argv[1])
n = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
body = json.dumps({"model": "gpt-4o", "temperature": 0,
                   "messages": [{"role": "system", "content": "You are terse."},
                                {"role": "user", "content": "What is the capital of France?"}]})
conn = http.client.HTTPConnection(url.hostname, url.port or 80)


def send(headers):
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json", **headers})
    response = conn.getresponse()
    response.read()
    return (time.perf_counter() - start) * 1000, response.getheader("x-ctxproxy-cache")


for _ in range(200):
    if send({})[1] == "hit":
        break
    time.sleep(0.01)
else:
    sys.exit("never a hit: is the store up and the cache enabled?")


def report(name, headers, count):
    samples = sorted(send(headers)[0] for _ in range(count))
    at = lambda q: samples[min(len(samples) - 1, int(q * len(samples)))]
    print(f"{name:<22} n={count} p50={at(0.5):.3f} ms p90={at(0.9):.3f} ms p99={at(0.99):.3f} ms max={samples[-1]:.3f} ms")


report("cache hit", {}, n)
report("no-cache (upstream)", {"Cache-Control": "no-cache"}, min(n, 200))
