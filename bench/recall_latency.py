#!/usr/bin/env python3
"""The latency a recall adds: an answer that calls `ctxproxy_recall` (answered by the proxy with
the original and asked again) against the same request answered at once, through ctxproxy in
front of `ctxproxy mock-upstream`, on loopback.

    cargo build --release && python3 bench/recall_latency.py [N]

For each mock latency in MOCK_LATENCIES_MS ("0,200"), starts the mock and a proxy as
bench/expansion_latency.py does (config.toml), and sends N (50) sequential requests per case on
one keep-alive connection, `Cache-Control: no-cache`, each its own conversation: an agent conversation of six query results
(about 800 tokens each), the older ones cleared with a handle, then a question. `X-Mock-Recall:
first` makes the mock recall the first handle. Cases: JSON and stream, each answered at once
and recalled. Prints p50/p90 of the time to the whole answer in ms as seen by this client;
"added" is the recall case's p50 minus the plain case's. Exit 1 if a recall was not answered
by the proxy (JSON: no `X-Ctxproxy-Recalled`; stream: the answer is not the one to the recalled
result) or the recall call reached the client.
"""
import http.client
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import expansion_latency as base  # noqa: E402  (the processes and the quantiles)

N = int(sys.argv[1]) if len(sys.argv) > 1 else 50


def conversation(stream):
    messages = [{"role": "user", "content": "Report revenue by region for six quarters."}]
    for step in range(6):
        rows = [{"region": f"R{step}-{row:02}", "revenue": 1000 + step * 100 + row,
                 "note": "Figures are net of returns and include every channel of the quarter."}
                for row in range(20)]
        call_id = f"call_{step}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": "run_query", "arguments": json.dumps({"quarter": step})}}]})
        messages.append({"role": "tool", "tool_call_id": call_id,
                         "content": json.dumps(rows, indent=2)})
    messages.append({"role": "assistant", "content": "I have all six quarters."})
    messages.append({"role": "user", "content": "Which region led in the first quarter?"})
    return json.dumps({"model": "gpt-4o", "stream": stream, "messages": messages, "tools": [
        {"type": "function", "function": {
            "name": "run_query", "description": "Run a revenue query for a quarter.",
            "parameters": {"type": "object", "properties": {"quarter": {"type": "integer"}}}}}]})


SENT = iter(range(1 << 62))


def one(conn, recall, stream):
    # A conversation of its own each time: a conversation that recalled once keeps the recalled
    # result in its later requests, so its next request is not asked to recall again.
    headers = {"Content-Type": "application/json", "Cache-Control": "no-cache",
               "X-Conversation-Id": f"recall-bench-{next(SENT)}"}
    if recall:
        headers["X-Mock-Recall"] = "first"
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", conversation(stream), headers)
    response = conn.getresponse()
    text = response.read().decode()
    total = (time.perf_counter() - start) * 1000
    if response.status != 200:
        sys.exit(f"unexpected answer ({response.status}): {text[:300]}")
    if stream:
        said = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                       for line in text.splitlines()
                       if line.startswith("data: {") and '"choices":[{' in line)
        recalled = said.startswith("Mock summary of the tool result")
    else:
        recalled = response.getheader("x-ctxproxy-recalled") is not None
    leaked = "ctxproxy_recall" in text
    return total, recalled and not leaked


def main():
    if not os.access(base.BIN, os.X_OK):
        print(f"no binary at {base.BIN}: cargo build --release", file=sys.stderr)
        sys.exit(2)
    print(f"{N} requests per case; times in ms at the client (p50 / p90)")
    print("| mock latency | mode | answered at once | recalled (re-asked) | added p50 |")
    print("|---|---|---|---|---|")
    failed = False
    for latency in base.LATENCIES:
        procs, port = base.start(latency)
        try:
            for stream in (False, True):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                times = {}
                for recall in (False, True):
                    one(conn, recall, stream)  # warm-up
                    runs = [one(conn, recall, stream) for _ in range(N)]
                    times[recall] = [t for t, _ in runs]
                    if recall and not all(ok for _, ok in runs):
                        print("a recall was not answered by the proxy", file=sys.stderr)
                        failed = True
                plain, recalled = times[False], times[True]
                q = base.quantile
                print(f"| {latency} ms | {'stream' if stream else 'JSON'} "
                      f"| {q(plain, .5):.2f} / {q(plain, .9):.2f} "
                      f"| {q(recalled, .5):.2f} / {q(recalled, .9):.2f} "
                      f"| {q(recalled, .5) - q(plain, .5):+.2f} |")
        finally:
            for p in procs:
                p.kill()
                p.wait()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
