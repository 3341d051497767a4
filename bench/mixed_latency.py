#!/usr/bin/env python3
"""What a small request waits for while other connections send large bodies rewritten cold.

    cargo build --release
    python3 bench/mixed_latency.py                      # 2 heavy connections, 10 s
    python3 bench/mixed_latency.py --heavy 0 --secs 5   # the small requests alone

Starts `ctxproxy mock-upstream` and `ctxproxy serve` (config.toml, memory store, log level warn)
on free 127.0.0.1 ports. `--heavy` connections each send, back to back, recorded MCPMark bodies
(../shared/data, $DATA: the Postgres and the GitHub/Notion agent files, read by path) with a
marker of their own in the first message, so every one is a conversation the proxy has never
seen (rewritten cold, 1-10 ms of work). One more connection sends a small chat request every
2 ms and times each. All requests carry `Cache-Control: no-store`; the mock answers at once.

Prints the small requests' p50 / p90 / p99 and the heavy requests sent. The proxy serves each
connection on one thread (`[server] threads`), so a small request waits for the heavy work of
its thread; this measures that wait. Bounded: `--secs` (10, at most 120) on loopback only.
Exit 2 when a process does not start or an answer is not 200.

Environment: CTXPROXY_BIN (target/release/ctxproxy, or $CARGO_TARGET_DIR/release/ctxproxy),
DATA (../shared/data), BENCH_CONFIG (config.toml).
"""
import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from procs import fail, free_port, wait_ready

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TARGET = os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target")
BIN = os.environ.get("CTXPROXY_BIN") or os.path.join(_TARGET, "release", "ctxproxy")
DATA = os.environ.get("DATA", os.path.join(ROOT, "..", "shared", "data"))
CONFIG = os.environ.get("BENCH_CONFIG", os.path.join(ROOT, "config.toml"))
HEAVY_FILES = ("mcpmark_postgres_dev.jsonl", "mcpmark_mcp_agent_trajectories.jsonl")
HEADERS = {"Content-Type": "application/json", "Cache-Control": "no-store",
           "Authorization": "Bearer sk-bench-not-a-real-key"}
SMALL = json.dumps({
    "model": "gpt-4o", "max_tokens": 64,
    "messages": [{"role": "system", "content": "You are a concise assistant."},
                 {"role": "user", "content": "What usually causes 'linker cc not found' on Alpine?"}],
}).encode()
SMALL_EVERY = 0.002


def heavy_bodies():
    bodies = []
    for name in HEAVY_FILES:
        path = os.path.join(DATA, name)
        if not os.path.exists(path):
            fail(f"{path} is missing (set DATA)")
        with open(path, encoding="utf-8") as f:
            bodies += [json.loads(line) for line in f if line.strip()]
    return bodies


def marked(body, marker):
    """`body` as a conversation of its own: `marker` ends its first message's text."""
    body = dict(body)
    messages = list(body["messages"])
    first = dict(messages[0])
    if isinstance(first.get("content"), str):
        first["content"] = f"{first['content']} [{marker}]"
    messages[0] = first
    body["messages"] = messages
    return json.dumps(body).encode()


def post(conn, body):
    conn.request("POST", "/v1/chat/completions", body, HEADERS)
    response = conn.getresponse()
    response.read()
    if response.status != 200:
        fail(f"an answer was {response.status}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heavy", type=int, default=2)
    parser.add_argument("--secs", type=float, default=10.0)
    args = parser.parse_args()
    secs = min(max(args.secs, 1.0), 120.0)
    bodies = heavy_bodies() if args.heavy else []
    logdir = tempfile.mkdtemp(prefix="ctxproxy-mixed-")
    mock_port, proxy_port = free_port(), free_port()
    with open(os.path.join(logdir, "mock.log"), "w") as mock_log, \
            open(os.path.join(logdir, "proxy.log"), "w") as proxy_log:
        mock = subprocess.Popen([BIN, "mock-upstream", "--listen", f"127.0.0.1:{mock_port}"],
                                stdout=mock_log, stderr=subprocess.STDOUT)
        env = {k: v for k, v in os.environ.items() if k not in ("RUST_LOG", "CTXPROXY_BIN")}
        env.update(CTXPROXY_UPSTREAM_BASE_URL=f"http://127.0.0.1:{mock_port}/v1",
                   CTXPROXY_STORE_BACKEND="memory", CTXPROXY_LOG_LEVEL="warn")
        proxy = subprocess.Popen([BIN, "serve", "--config", CONFIG, "--listen",
                                  f"127.0.0.1:{proxy_port}"],
                                 stdout=proxy_log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_ready(mock_port, "/v1/models", mock, "mock-upstream")
            wait_ready(proxy_port, "/healthz", proxy, "ctxproxy serve")
            run(proxy_port, bodies, args.heavy, secs)
        finally:
            for proc in (proxy, mock):
                proc.terminate()
                proc.wait(timeout=10)


def run(port, bodies, heavy, secs):
    stop = time.monotonic() + secs
    sent = [0] * heavy
    small = []

    def send_heavy(k):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        i = k
        while time.monotonic() < stop:
            post(conn, marked(bodies[i % len(bodies)], f"mixed-{k}-{i}"))
            sent[k] += 1
            i += heavy

    def send_small():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        for _ in range(20):
            post(conn, SMALL)
        while time.monotonic() < stop:
            started = time.perf_counter()
            post(conn, SMALL)
            small.append(time.perf_counter() - started)
            time.sleep(SMALL_EVERY)

    threads = [threading.Thread(target=send_heavy, args=(k,)) for k in range(heavy)]
    threads.append(threading.Thread(target=send_small))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    small.sort()
    at = lambda q: 1e3 * small[min(len(small) - 1, int(q * len(small)))]
    print(f"small requests: {len(small)}, p50 {at(0.5):.2f} ms, p90 {at(0.9):.2f} ms, "
          f"p99 {at(0.99):.2f} ms; heavy requests sent on {heavy} connections: {sum(sent)}")


if __name__ == "__main__":
    sys.exit(main())
