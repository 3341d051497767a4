#!/usr/bin/env python3
"""The latency a tool expansion adds: a call of a stub (re-asked with its definition) against a
call of a tool sent in full, through ctxproxy in front of `ctxproxy mock-upstream`, on loopback.

    cargo build --release && python3 bench/expansion_latency.py [N]

For each mock latency in MOCK_LATENCIES_MS ("0,200": the mock alone, then a model that takes
200 ms to its first byte), starts the mock and a proxy (config.toml, tool filtering on every
request: `CTXPROXY_TOOLS_MIN_TOOL_TOKENS=0`) on free ports, and sends
N (100) sequential requests per case on one keep-alive connection, `Cache-Control: no-cache`.
The request offers a short `get_weather` and a long `send_email` and asks about the weather:
`get_weather` goes in full (shorter than `min_stub_tokens`), `send_email` as a stub.
`X-Mock-Tool-Call` makes the mock call one or the other. Cases: JSON and stream, each with
the full tool called and with the stub called.

Prints p50/p90 of the time to the whole answer and, for streams, to the first tool-call delta
(what an agent waits for), in ms as seen by this client; "added" is the stub case's p50 minus
the full case's. Also the proxy's own `ctxproxy_tool_expansion_duration_seconds` mean (the
re-ask's upstream time). Exit 1 if an answer is not the expected call, or a stub call was not
expanded; 2 on a usage error or when a process does not start.
"""
import http.client
import json
import os
import subprocess
import sys
import time

from procs import free_port, wait_ready

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("CTXPROXY_BIN", os.path.join(ROOT, "target", "release", "ctxproxy"))
LATENCIES = [int(x) for x in os.environ.get("MOCK_LATENCIES_MS", "0,200").split(",")]
N = int(sys.argv[1]) if len(sys.argv) > 1 else 100

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the weather forecast for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "send_email",
        "description": "Send an email to one or more contacts on the user's behalf. Use it only "
                       "after the user has confirmed the recipients, the subject and the body; "
                       "attachments must be files the user already uploaded in this conversation.",
        "parameters": {"type": "object", "properties": {
            "to": {"type": "array", "items": {"type": "string"},
                   "description": "Recipients' email addresses."},
            "cc": {"type": "array", "items": {"type": "string"},
                   "description": "Addresses in copy, if any."},
            "subject": {"type": "string", "description": "The subject line, under 80 characters."},
            "body": {"type": "string", "description": "The message, in plain text or Markdown."},
            "attachments": {"type": "array", "items": {"type": "string"},
                            "description": "Ids of uploaded files to attach."},
            "send_at": {"type": "string", "description": "ISO 8601 time to send it; now if absent."}},
            "required": ["to", "subject", "body"]}}},
]
QUESTION = "What is the weather in Paris tomorrow?"


def start(latency_ms):
    mock_port, proxy_port = free_port(), free_port()
    mock = subprocess.Popen([BIN, "mock-upstream", "--listen", f"127.0.0.1:{mock_port}",
                             "--latency-ms", str(latency_ms)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTXPROXY_")}
    env.update(CTXPROXY_UPSTREAM_BASE_URL=f"http://127.0.0.1:{mock_port}/v1",
               CTXPROXY_STORE_BACKEND="memory", CTXPROXY_LOG_LEVEL="warn",
               CTXPROXY_TOOLS_MIN_TOOL_TOKENS="0")
    proxy = subprocess.Popen([BIN, "serve", "--config", os.path.join(ROOT, "config.toml"),
                              "--listen", f"127.0.0.1:{proxy_port}"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(mock_port, "/v1/models", mock)
    wait_ready(proxy_port, "/healthz", proxy)
    return [mock, proxy], proxy_port


def one(conn, called, stream):
    body = json.dumps({"model": "gpt-4o", "stream": stream, "tools": TOOLS,
                       "messages": [{"role": "user", "content": QUESTION}]})
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body,
                 {"Content-Type": "application/json", "Cache-Control": "no-cache",
                  "X-Mock-Tool-Call": called})
    response = conn.getresponse()
    first_call = None
    if stream:
        chunks = []
        while line := response.readline():
            chunks.append(line)
            if first_call is None and b'"tool_calls"' in line:
                first_call = time.perf_counter() - start
        text = b"".join(chunks).decode()
        expanded = "x-ctxproxy-tools-expanded: " + called in text
    else:
        text = response.read().decode()
        expanded = response.getheader("x-ctxproxy-tools-expanded") == called
    total = time.perf_counter() - start
    if response.status != 200 or f'"name":"{called}"' not in text.replace(" ", ""):
        sys.exit(f"unexpected answer ({response.status}) for a call of {called}: {text[:300]}")
    return total * 1000, (first_call or total) * 1000, expanded


def quantile(samples, q):
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def expansion_mean_ms(port):
    conn = http.client.HTTPConnection("127.0.0.1", port)
    conn.request("GET", "/metrics")
    total = count = 0.0
    for line in conn.getresponse().read().decode().splitlines():
        if line.startswith("ctxproxy_tool_expansion_duration_seconds_sum"):
            total = float(line.split()[-1])
        elif line.startswith("ctxproxy_tool_expansion_duration_seconds_count"):
            count = float(line.split()[-1])
    return 1000 * total / count if count else float("nan")


def main():
    if not os.access(BIN, os.X_OK):
        print(f"no binary at {BIN}: cargo build --release", file=sys.stderr)
        sys.exit(2)
    print(f"{N} requests per case; times in ms at the client (p50 / p90)")
    print("| mock latency | mode | full tool called | stub called (re-asked) | added p50 "
          "| first call delta, full | stub | proxy's re-ask mean |")
    print("|---|---|---|---|---|---|---|---|")
    failed = False
    for latency in LATENCIES:
        procs, port = start(latency)
        try:
            for stream in (False, True):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                results = {}
                for called in ("get_weather", "send_email"):
                    one(conn, called, stream)  # warm-up
                    runs = [one(conn, called, stream) for _ in range(N)]
                    results[called] = runs
                    want_expanded = called == "send_email"
                    if any(r[2] != want_expanded for r in runs):
                        print(f"a call of {called} was {'not ' if want_expanded else ''}expanded",
                              file=sys.stderr)
                        failed = True
                full = [r[0] for r in results["get_weather"]]
                stub = [r[0] for r in results["send_email"]]
                cells = [f"{latency} ms", "stream" if stream else "JSON",
                         f"{quantile(full, .5):.2f} / {quantile(full, .9):.2f}",
                         f"{quantile(stub, .5):.2f} / {quantile(stub, .9):.2f}",
                         f"{quantile(stub, .5) - quantile(full, .5):+.2f}"]
                if stream:
                    cells += [f"{quantile([r[1] for r in results[c]], .5):.2f}"
                              for c in ("get_weather", "send_email")]
                else:
                    cells += ["–", "–"]
                cells.append(f"{expansion_mean_ms(port):.2f}")
                print("| " + " | ".join(cells) + " |")
        finally:
            for p in procs:
                p.kill()
                p.wait()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
