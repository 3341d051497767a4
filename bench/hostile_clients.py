#!/usr/bin/env python3
"""Slow, idle and hostile clients against a running ctxproxy, on loopback (issue: hardening).

    python3 bench/hostile_clients.py http://127.0.0.1:8080 PROXY_PID [N]

Opens N (2000) slowloris connections (a request line, then one header byte every 2 s), N idle
connections (connected, never a byte), 200 requests whose body never ends and 200 clients that
leave before the answer; at the end, one 100 MB streamed answer at temperature 0; then measures normal requests while all of that is open, the proxy's
RSS (from /proc/PROXY_PID/status), and how long the timeouts take to close every hostile
connection. Prints one line per measure with the target beside it:

  normal request while under attack: p50/max < 100 ms
  RSS with everything open: < 400 MB
  every slowloris, idle and unfinished-body connection closed by the timeouts
  ctxproxy_in_flight_requests back where it started

Bounded: it stops waiting after 150 s. Raise `ulimit -n` above 2N + 1000 first (the script
tries). Run the proxy against `ctxproxy mock-upstream --latency-ms 3000` so that the leaving
clients leave before the answer, e.g.:

    ctxproxy mock-upstream --listen 127.0.0.1:19100 --latency-ms 3000 &
    CTXPROXY_UPSTREAM_BASE_URL=http://127.0.0.1:19100/v1 CTXPROXY_STORE_BACKEND=memory \\
      ctxproxy serve --listen 127.0.0.1:19180 & echo $!
"""
import asyncio
import json
import resource
import sys
import time
from urllib.parse import urlparse

URL = urlparse(sys.argv[1])
PID = int(sys.argv[2])
N = int(sys.argv[3]) if len(sys.argv) > 3 else 2000
HOST, PORT = URL.hostname, URL.port or 80
BODY = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hi"}]})
GIVE_UP_S = 150


def raise_fd_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, 2 * N + 1000))
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def rss_mb():
    with open(f"/proc/{PID}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def metric(name):
    reader, writer = await asyncio.open_connection(HOST, PORT)
    writer.write(f"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    text = (await reader.read()).decode(errors="replace")
    writer.close()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


async def wait_closed(reader, started, closed):
    """Reads until the server closes; records how long after `started` it did."""
    try:
        while await reader.read(4096):
            pass
    except (ConnectionError, OSError):
        pass
    closed.append(time.monotonic() - started)


CONNECT_FAILED = []


async def connect():
    """A connection, or None when the kernel refused it (a burst past the listen backlog)."""
    try:
        return await asyncio.open_connection(HOST, PORT)
    except OSError:
        CONNECT_FAILED.append(1)
        return None


async def slowloris(closed):
    if not (connection := await connect()):
        return
    reader, writer = connection
    started = time.monotonic()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    watcher = asyncio.create_task(wait_closed(reader, started, closed))
    try:
        while not watcher.done():
            await asyncio.sleep(2)
            writer.write(b"X")
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    await watcher


async def idle(closed):
    if not (connection := await connect()):
        return
    reader, _writer = connection
    await wait_closed(reader, time.monotonic(), closed)


async def unfinished_body(closed):
    reader, writer = await asyncio.open_connection(HOST, PORT)
    started = time.monotonic()
    writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(BODY) + 100}\r\n\r\n{BODY[:20]}".encode())
    await writer.drain()
    await wait_closed(reader, started, closed)


async def leaves_early():
    reader, writer = await asyncio.open_connection(HOST, PORT)
    writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(BODY)}\r\n\r\n{BODY}".encode())
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.close()


async def normal_request():
    started = time.monotonic()
    reader, writer = await asyncio.open_connection(HOST, PORT)
    writer.write(f"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    answer = await reader.read()
    writer.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:80]
    return (time.monotonic() - started) * 1000


async def large_streamed_answer(megabytes=100):
    """A temperature-0 streamed answer of `megabytes` MB (the mock's X-Mock-Reply-Repeat): read
    whole, with the proxy's peak RSS meanwhile and whether the same request is then a cache hit
    (it must not be: answers over [cache] max_entry_bytes are never stored)."""
    text = "x" * 1023
    body = json.dumps({"model": "gpt-4o-mini", "temperature": 0, "stream": True,
                       "messages": [{"role": "user", "content": "A very long story, please."}]})
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
               f"Content-Type: application/json\r\nX-Mock-Latency-Ms: 0\r\nX-Mock-Reply: {text}\r\n"
               f"X-Mock-Reply-Repeat: {megabytes * 1024}\r\nContent-Length: {len(body)}\r\n\r\n{body}")
    peak = [rss_mb()]

    async def sample():
        while True:
            peak[0] = max(peak[0], rss_mb())
            await asyncio.sleep(0.05)

    async def send():
        reader, writer = await asyncio.open_connection(HOST, PORT)
        writer.write(request.encode())
        received, head = 0, b""
        while chunk := await reader.read(1 << 20):
            if not head:
                head = chunk[:400]
            received += len(chunk)
        writer.close()
        cache = [line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
                 if line.lower().startswith(b"x-ctxproxy-cache:")]
        return received, cache[0] if cache else "-"

    sampler = asyncio.create_task(sample())
    started = time.monotonic()
    received, _ = await send()
    elapsed = time.monotonic() - started
    sampler.cancel()
    _, second = await send()
    await asyncio.sleep(2)
    print(f"large streamed answer: {received / 1e6:.0f} MB relayed in {elapsed:.1f} s, proxy peak RSS "
          f"{peak[0]:.0f} MB, {rss_mb():.0f} MB 2 s later; the same request again: cache {second} "
          f"(target: miss, memory bounded)")


async def main():
    raise_fd_limit()
    in_flight_before = await metric("ctxproxy_in_flight_requests")
    rss_before = rss_mb()
    closed = {"slowloris": [], "idle": [], "unfinished body": []}
    tasks = []
    for i in range(N):
        tasks.append(asyncio.create_task(slowloris(closed["slowloris"])))
        tasks.append(asyncio.create_task(idle(closed["idle"])))
        if i % 100 == 99:
            # Paced, so the burst stays within the listen backlog: a connection the kernel
            # completes but drops from a full accept queue never reaches the proxy at all.
            await asyncio.sleep(0.05)
    for _ in range(200):
        tasks.append(asyncio.create_task(unfinished_body(closed["unfinished body"])))
        tasks.append(asyncio.create_task(leaves_early()))
    await asyncio.sleep(3)
    latencies = sorted([await normal_request() for _ in range(50)])
    rss_open = rss_mb()
    open_connections = await metric("ctxproxy_open_connections")
    print(f"open: {open_connections:.0f} connections; RSS {rss_before:.0f} MB before, {rss_open:.0f} MB "
          f"with everything open (target < 400 MB)")
    print(f"normal request while under attack: p50 {latencies[len(latencies) // 2]:.1f} ms, "
          f"max {latencies[-1]:.1f} ms (target < 100 ms)")
    done, pending = await asyncio.wait(tasks, timeout=GIVE_UP_S)
    for task in pending:
        task.cancel()
    errors = [t.exception() for t in done if not t.cancelled() and t.exception()]
    if errors:
        print(f"client-side errors: {len(errors)}, e.g. {errors[0]!r}")
    for kind, times in closed.items():
        expected = N if kind != "unfinished body" else 200
        slowest = f", the last after {max(times):.1f} s" if times else ""
        print(f"{kind}: {len(times)} of {expected} closed by the proxy{slowest}")
    in_flight_after = await metric("ctxproxy_in_flight_requests")
    print(f"connections the kernel refused during the burst (not the proxy): {len(CONNECT_FAILED)}")
    print(f"in-flight gauge: {in_flight_before:.0f} before, {in_flight_after:.0f} after (target: equal)")
    print(f"RSS after: {rss_mb():.0f} MB")
    await large_streamed_answer()


asyncio.run(main())
