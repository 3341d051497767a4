#!/usr/bin/env python3
"""What ctxproxy keeps in memory under traffic it has never seen, and whether it gives it back.

    cargo build --release
    python3 bench/memory.py distinct [N] [KB]     # N (400) requests, each a distinct KB (1024) tool result
    python3 bench/memory.py soak [MINUTES] [FILE…] # replay of the dev files for MINUTES (20)
    python3 bench/memory.py streams [N] [RAMP]     # idle RSS, and with N (1,000) streams in flight

Starts `ctxproxy mock-upstream` and `ctxproxy serve` (config.toml; the store is Redis when one
answers at CTXPROXY_STORE_REDIS_URL / redis://127.0.0.1:6379, else memory; its keys go under a
prefix of their own) on free loopback ports, and samples the proxy's RSS (/proc/<pid>/status).

`distinct`: the idle RSS after one warm-up request, then N agent requests (4 at a time), each a
conversation whose tool result is a distinct JSON list or text table of about KB kilobytes
(SHAPE: two_turns, one_turn or log, see below); prints the peak
RSS, the RSS at the end of the load and a minute after it stopped, with the caches' bytes
(`ctxproxy_memory_cache_bytes`). Targets (issue 29): end < 300 MB; a minute later within 20% of
the idle RSS.

`soak`: `ctxproxy replay` of the dev files (tau2 dev, the MCPMark files, the GitHub tool
results) at RATE (20) requests/s for MINUTES, RSS sampled every 10 s; prints the samples and the
spread of the last half around its mean. Target: within ±10%.

`streams`: the RSS of a proxy just started (`serve`, nothing sent) and idle 6 s after one
request (a housekeeping sweep later, when the allocator has given back what it freed), then
with N streamed agent requests (each ~6 KB, a conversation of its own) in flight: they are
opened evenly over RAMP seconds (5; 0 sends them all at once), the mock streams 1 token/s (10
with RAMP 0) so that each stream outlasts the ramp, and the RSS is sampled every 0.2 s. It
prints the RSS once every stream is open and has stayed open for a second (what N streams in
flight hold), and the peak (with RAMP 0, what N requests arriving at once cost on top).
Targets (issue 34): idle ≤ 60 MB; ≤ 100 MB with 1,000 streams in flight.

Exit 1 when a target is missed, 2 on a usage error or when a process does not start.
"""
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time

from procs import free_port, wait_ready

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("CTXPROXY_BIN", os.path.join(ROOT, "target", "release", "ctxproxy"))
DATA = os.environ.get("DATA", os.path.join(ROOT, "..", "shared", "data"))
REDIS_URL = os.environ.get("CTXPROXY_STORE_REDIS_URL", "redis://127.0.0.1:6379")
SOAK_FILES = ["tau2_bench_dev.jsonl", "mcpmark_postgres_dev.jsonl",
              "mcpmark_mcp_agent_trajectories.jsonl", "github_api_tool_results.jsonl"]
MB = 1024 * 1024
# The requests of `distinct`: "two_turns" (the big result outside the working set: cleared),
# "one_turn" (the big result is the latest tool step: kept whole), "log" (two turns, the result
# is log lines of text), "blob" (two turns, the result is a file's metadata and its content in
# base64, as the GitHub API returns it).
SHAPE = os.environ.get("SHAPE", "two_turns")


def redis_answers():
    host_port = REDIS_URL.split("//", 1)[-1].split("/", 1)[0]
    host, _, port = host_port.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port or 6379)), timeout=0.5):
            return True
    except OSError:
        return False


def start(logdir, mock_args=()):
    mock_port, proxy_port = free_port(), free_port()
    mock = subprocess.Popen([BIN, "mock-upstream", "--listen", f"127.0.0.1:{mock_port}",
                             *mock_args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTXPROXY_")}
    backend = "redis" if redis_answers() else "memory"
    env.update(CTXPROXY_UPSTREAM_BASE_URL=f"http://127.0.0.1:{mock_port}/v1",
               CTXPROXY_STORE_BACKEND=backend, CTXPROXY_STORE_REDIS_URL=REDIS_URL,
               CTXPROXY_STORE_KEY_PREFIX=f"bench-memory:{os.getpid()}:{random.random()}:",
               CTXPROXY_LOG_LEVEL="warn")
    env.update({k: v for k, v in os.environ.items() if k.startswith("CTXPROXY_")
                and k not in ("CTXPROXY_BIN",)})
    log = open(os.path.join(logdir, "proxy.log"), "w")
    proxy = subprocess.Popen([BIN, "serve", "--config", os.path.join(ROOT, "config.toml"),
                              "--listen", f"127.0.0.1:{proxy_port}"],
                             env=env, stdout=log, stderr=log)
    wait_ready(mock_port, "/v1/models", mock)
    wait_ready(proxy_port, "/healthz", proxy)
    print(f"store: {env['CTXPROXY_STORE_BACKEND']}; logs in {logdir}")
    return [mock, proxy], proxy, proxy_port, mock_port


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def cache_bytes(port):
    """The proxy's `ctxproxy_memory_cache_bytes` gauges, in MB, by cache."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("ctxproxy_memory_cache_bytes{"):
            labels, value = line.rsplit(" ", 1)
            name = labels.split('cache="', 1)[1].split('"', 1)[0]
            out[name] = round(float(value) / MB, 1)
    return out


def tool_result(n, kb):
    """About `kb` kilobytes of orders, every value distinct to request `n`: a JSON list for even
    `n`, an aligned text table (what database tools print) for odd ones."""
    rng = random.Random(n)
    rows, size = [], 0
    while size < kb * 1024:
        row = {"order_id": f"#W{n:04d}{len(rows):05d}", "customer": f"user_{rng.randrange(10**9)}",
               "status": rng.choice(["pending", "shipped", "delivered"]),
               "total": round(rng.uniform(1, 999), 2), "sku": hex(rng.getrandbits(64)),
               "note": " ".join(rng.choice(["fragile", "gift", "express", "returned", "bulk"])
                                for _ in range(8))}
        rows.append(row)
        size += len(json.dumps(row)) + 2
    if SHAPE == "blob":
        # A file as the GitHub API returns it: metadata and the content in base64.
        import base64
        content = base64.b64encode(rng.randbytes(kb * 768)).decode()
        return json.dumps({"name": f"report_{n}.csv", "path": f"data/report_{n}.csv",
                           "sha": hex(rng.getrandbits(160))[2:], "size": kb * 768,
                           "encoding": "base64", "content": content})
    if SHAPE == "log":
        return "\n".join(f"2026-11-{1 + i % 28:02d}T10:{i % 60:02d}:00Z INFO order {r['order_id']} "
                         f"for {r['customer']} is {r['status']} ({r['note']}) sku={r['sku']}"
                         for i, r in enumerate(rows))
    if n % 2 == 0:
        return json.dumps(rows)
    lines = [" | ".join(rows[0].keys())]
    lines += [" | ".join(str(v) for v in row.values()) for row in rows]
    return "\n".join(lines)


def agent_request(n, kb):
    """Two turns of an agent: the big result is in the first, outside the working set of the
    second (cleared, its identifiers in the ledger); the second turn's result is small."""
    def call(i, name, args):
        return {"id": f"call_{n}_{i}", "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)}}
    tools = [{"type": "function", "function": {
        "name": name, "description": f"{name.replace('_', ' ').capitalize()} of the customer.",
        "parameters": {"type": "object", "properties": {"page": {"type": "integer"}}}}}
        for name in ("list_orders", "get_order")]
    return json.dumps({
        "model": "gpt-4o", "temperature": 0, "tools": tools,
        "messages": ([
            {"role": "system", "content": "You are a support agent for an online shop."},
            {"role": "user", "content": f"Which of my orders are still pending? (case {n})"},
            {"role": "assistant", "content": None,
             "tool_calls": [call(1, "list_orders", {"page": n})]},
            {"role": "tool", "tool_call_id": f"call_{n}_1", "content": tool_result(n, kb)},
            {"role": "assistant", "content": f"Several orders are pending, e.g. #W{n:04d}00001."},
            {"role": "user", "content": "Show me the first one."},
            {"role": "assistant", "content": None,
             "tool_calls": [call(2, "get_order", {"order_id": f"#W{n:04d}00001"})]},
            {"role": "tool", "tool_call_id": f"call_{n}_2",
             "content": json.dumps({"order_id": f"#W{n:04d}00001", "status": "pending"})},
        ])[:4 if SHAPE == "one_turn" else None]})


class Sampler(threading.Thread):
    def __init__(self, pid, every):
        super().__init__(daemon=True)
        self.pid, self.every, self.samples, self.stop = pid, every, [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.samples.append((time.time(), rss_mb(self.pid)))
            self.stop.wait(self.every)


def post(port, body):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    response.read()
    return response.status


def distinct(n, kb):
    logdir = tempfile.mkdtemp(prefix="ctxproxy-memory-")
    procs, proxy, port, _ = start(logdir)
    try:
        post(port, agent_request(10**6, 4))
        time.sleep(2)
        idle = rss_mb(proxy.pid)
        sampler = Sampler(proxy.pid, 0.5)
        sampler.start()
        started, failures, lock = time.time(), [], threading.Lock()
        queue = list(range(n))

        def worker():
            while True:
                with lock:
                    if not queue:
                        return
                    i = queue.pop()
                status = post(port, agent_request(i, kb))
                if status != 200:
                    failures.append(status)
        workers = [threading.Thread(target=worker) for _ in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        end = rss_mb(proxy.pid)
        caches_end = cache_bytes(port)
        print(f"{n} requests of ~{kb} KB in {time.time() - started:.0f} s, {len(failures)} failed")
        time.sleep(60)
        after = rss_mb(proxy.pid)
        caches_after = cache_bytes(port)
        sampler.stop.set()
        peak = max(r for _, r in sampler.samples)
        print(f"RSS idle {idle:.0f} MB, peak {peak:.0f} MB, end of load {end:.0f} MB, "
              f"a minute later {after:.0f} MB ({100 * (after / idle - 1):+.0f}% of idle)")
        print(f"caches at the end (MB): {caches_end}")
        print(f"caches a minute later (MB): {caches_after}")
        ok_end, ok_after = end < 300, after <= idle * 1.2
        print(f"target end < 300 MB: {'met' if ok_end else 'MISSED'}; "
              f"a minute later within 20% of idle: {'met' if ok_after else 'MISSED'}")
        return 0 if ok_end and ok_after and not failures else 1
    finally:
        for p in procs:
            p.terminate()


def soak(minutes, files):
    logdir = tempfile.mkdtemp(prefix="ctxproxy-memory-")
    procs, proxy, port, _ = start(logdir)
    rate = os.environ.get("RATE", "20")
    try:
        replay = subprocess.Popen(
            [BIN, "replay", *files, "--target", f"http://127.0.0.1:{port}", "--rate", rate,
             "--duration", f"{int(minutes * 60)}s", "--vary-user", "--timeout-secs", "30",
             "--output", os.path.join(logdir, "replay.json")],
            stdout=open(os.path.join(logdir, "replay.txt"), "w"), stderr=subprocess.STDOUT)
        samples, start_time = [], time.time()
        while replay.poll() is None:
            time.sleep(10)
            samples.append((time.time() - start_time, rss_mb(proxy.pid)))
            print(f"{samples[-1][0]:6.0f} s  RSS {samples[-1][1]:6.0f} MB  "
                  f"caches {cache_bytes(port)}", flush=True)
        last = [r for t, r in samples if t >= minutes * 30]
        if not last:
            print("too short to judge", file=sys.stderr)
            return 2
        mean = sum(last) / len(last)
        spread = max(abs(r / mean - 1) for r in last)
        print(f"last half: mean {mean:.0f} MB, min {min(last):.0f}, max {max(last):.0f}, "
              f"spread ±{100 * spread:.1f}% (target ±10%: {'met' if spread <= 0.10 else 'MISSED'})")
        print(open(os.path.join(logdir, "replay.txt")).read()[-800:])
        return 0 if spread <= 0.10 else 1
    finally:
        for p in procs:
            p.terminate()


async def hold_stream(port, body, opened, done, after=0.0):
    """One streamed request, sent `after` seconds from now: counted in `opened` once its first
    chunk arrived, read to its end."""
    import asyncio
    await asyncio.sleep(after)
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode()
    writer.write(head + body)
    await writer.drain()
    seen = b""
    while True:
        chunk = await reader.read(65536)
        if not chunk:
            break
        if opened is not None and b"data:" in seen + chunk:
            opened.append(1)
            opened = None
        seen = chunk[-8:]
    done.append(1)
    writer.close()


def streams(n, ramp):
    import asyncio
    logdir = tempfile.mkdtemp(prefix="ctxproxy-memory-")
    procs, proxy, port, _ = start(logdir, ["--tokens-per-sec", "1" if ramp > 0 else "10"])
    try:
        time.sleep(2)
        started = rss_mb(proxy.pid)
        post(port, agent_request(10**6, 4))
        # A housekeeping sweep (every 5 s) later: what the allocator freed is given back then.
        time.sleep(6)
        idle = rss_mb(proxy.pid)
        bodies = []
        for i in range(n):
            body = json.loads(agent_request(i, 4))
            body["stream"] = True
            bodies.append(json.dumps(body).encode())
        opened, done, peak = [], [], [0.0]

        async def run():
            tasks = [asyncio.create_task(hold_stream(port, b, opened, done, ramp * i / n))
                     for i, b in enumerate(bodies)]
            all_open_since, all_open_rss = None, None
            while len(done) < n:
                await asyncio.sleep(0.2)
                rss = rss_mb(proxy.pid)
                peak[0] = max(peak[0], rss)
                if len(opened) == n and not done:
                    all_open_since = all_open_since or time.time()
                    if all_open_rss is None and time.time() - all_open_since >= 1.0:
                        all_open_rss = rss
                if all(t.done() for t in tasks):
                    break
            for t in tasks:
                if t.exception():
                    print(f"a stream failed: {t.exception()!r}", file=sys.stderr)
            return all_open_rss

        t0 = time.time()
        all_open = asyncio.run(run())
        print(f"{n} streams over {ramp:g} s, {len(opened)} opened, {len(done)} ended, "
              f"in {time.time() - t0:.1f} s")
        time.sleep(3)
        print(f"RSS 3 s after the last ended {rss_mb(proxy.pid):.0f} MB; caches (MB): "
              f"{cache_bytes(port)}")
        ok_idle = idle <= 60
        ok_open = all_open is not None and all_open <= 100 and len(done) == n
        print(f"RSS just started {started:.0f} MB, idle after one request {idle:.0f} MB "
              f"(target ≤ 60: {'met' if ok_idle else 'MISSED'})")
        if all_open is None:
            print(f"the {n} streams were never all open for a second (peak {peak[0]:.0f} MB): "
                  f"lower RAMP")
        else:
            print(f"RSS with every stream open {all_open:.0f} MB (target ≤ 100: "
                  f"{'met' if ok_open else 'MISSED'}), peak {peak[0]:.0f} MB")
        return 0 if ok_idle and ok_open else 1
    finally:
        for p in procs:
            p.terminate()


def main():
    if not os.path.exists(BIN):
        print(f"no binary at {BIN}: cargo build --release", file=sys.stderr)
        return 2
    mode = sys.argv[1] if len(sys.argv) > 1 else "distinct"
    if mode == "distinct":
        n = int(sys.argv[2]) if len(sys.argv) > 2 else 400
        kb = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
        return distinct(n, kb)
    if mode == "soak":
        minutes = float(sys.argv[2]) if len(sys.argv) > 2 else 20
        files = sys.argv[3:] or [os.path.join(DATA, f) for f in SOAK_FILES
                                 if os.path.exists(os.path.join(DATA, f))]
        if not files:
            print(f"no data files in {DATA}", file=sys.stderr)
            return 2
        return soak(minutes, files)
    if mode == "streams":
        return streams(int(sys.argv[2]) if len(sys.argv) > 2 else 1000,
                       float(sys.argv[3]) if len(sys.argv) > 3 else 5.0)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
