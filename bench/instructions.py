#!/usr/bin/env python3
"""The proxy's CPU work per recorded request, counted in instructions: a measure that this
noisy 2-core machine does not move, for comparing two builds on the same traffic.

    cargo build --release
    python3 bench/instructions.py FILE [FILE...] [--limit N] [--top K]
    CTXPROXY_BIN=/tmp/ctxproxy-before python3 bench/instructions.py tau2_bench_dev_every_turn.jsonl

Starts `ctxproxy mock-upstream` and `ctxproxy serve` (config.toml, memory store, log level warn)
on free 127.0.0.1 ports, the proxy under `valgrind --tool=callgrind` with collection off; once
both answer, turns collection on, sends every request of FILE in order on one keep-alive
connection (a chat body to /v1/chat/completions, a Responses body to /v1/responses, with
`Cache-Control: no-store`), dumps, and prints the instructions the proxy executed per request
(user space, every thread: parse, rewrite, send, relay). Requests in order are what a replica
serving the file would see: a file of snapshots (tau2 dev, MCPMark) is cold, every turn in order
is warm. `--top K` also prints the K functions with the most instructions, inclusive; `--keep DIR`
keeps the callgrind dump there (for `callgrind_annotate --tree=caller`).

Files are names in $DATA (../shared/data) or paths. Needs valgrind (`apt-get install valgrind`);
the proxy runs 30-60x slower under it, so a file of 400 requests takes a minute or two.
Instruction counts leave out the kernel, waiting, and cache misses: they rank code changes, and
bench/real_latency.py says what they are worth in milliseconds.
"""
import argparse
import glob
import http.client
import os
import shutil
import subprocess
import sys
import tempfile

from procs import fail, free_port, wait_ready

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("CTXPROXY_BIN", os.path.join(ROOT, "target", "release", "ctxproxy"))
DATA = os.environ.get("DATA", os.path.join(ROOT, "..", "shared", "data"))


def is_responses(body):
    return b'"messages"' not in body and b'"input"' in body


def measure(path, limit, top, workdir, keep):
    bodies = [line for line in open(path, "rb") if line.strip()][:limit]
    if not bodies:
        fail(f"{path} holds no request")
    mock_port, proxy_port = free_port(), free_port()
    mock = subprocess.Popen(
        [BIN, "mock-upstream", "--listen", f"127.0.0.1:{mock_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # CTXPROXY_BIN is this script's: the proxy would read it as a setting it does not know.
    env = {k: v for k, v in os.environ.items() if k != "CTXPROXY_BIN"}
    env.update(CTXPROXY_STORE_BACKEND="memory", CTXPROXY_LOG_LEVEL="warn",
               CTXPROXY_UPSTREAM_BASE_URL=f"http://127.0.0.1:{mock_port}/v1")
    out = os.path.join(workdir, "callgrind.out")
    proxy = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
         BIN, "serve", "--config", os.path.join(ROOT, "config.toml"),
         "--listen", f"127.0.0.1:{proxy_port}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(mock_port, "/v1/models", mock, "mock")
        wait_ready(proxy_port, "/healthz", proxy, "proxy under callgrind", tries=3000)
        control = lambda *args: subprocess.run(["callgrind_control", *args, str(proxy.pid)],
                                               stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL, check=True)
        control("-i", "on")
        conn = http.client.HTTPConnection("127.0.0.1", proxy_port, timeout=600)
        errors = 0
        for body in bodies:
            route = "/v1/responses" if is_responses(body) else "/v1/chat/completions"
            conn.request("POST", route, body=body, headers={
                "Content-Type": "application/json", "Authorization": "Bearer bench",
                "Cache-Control": "no-store"})
            answer = conn.getresponse()
            answer.read()
            errors += answer.status != 200
        control("-d")
    finally:
        proxy.terminate()
        proxy.wait()
        mock.kill()
        mock.wait()
    dumps = [f for f in glob.glob(out + "*") if os.path.getsize(f) > 0]
    total = 0
    for dump in dumps:
        for line in open(dump):
            if line.startswith("totals:") or line.startswith("summary:"):
                total = max(total, int(line.split()[1]))
    name = os.path.basename(path)
    print(f"{name}: {len(bodies)} requests, {errors} not 200, "
          f"{total / len(bodies) / 1e6:.3f} M instructions per request")
    if keep:
        os.makedirs(keep, exist_ok=True)
        for dump in dumps:
            shutil.copy(dump, os.path.join(keep, name + "." + os.path.basename(dump)))
    if top and dumps:
        biggest = max(dumps, key=os.path.getsize)
        listing = subprocess.run(
            ["callgrind_annotate", "--inclusive=yes", "--tree=none", biggest],
            capture_output=True, text=True).stdout
        rows = [line for line in listing.splitlines() if "ctxproxy::" in line]
        for line in rows[:top]:
            print("   ", line.strip()[:160])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--limit", type=int, default=10**9)
    parser.add_argument("--top", type=int, default=0)
    parser.add_argument("--keep", metavar="DIR")
    args = parser.parse_args()
    if not shutil.which("valgrind"):
        fail("valgrind is not installed (apt-get install valgrind)")
    for name in args.files:
        path = name if os.path.exists(name) else os.path.join(DATA, name)
        if not os.path.exists(path):
            fail(f"no file {name} (nor {path})")
        with tempfile.TemporaryDirectory(prefix="ctxproxy-instructions.") as workdir:
            measure(path, args.limit, args.top, workdir, args.keep)


if __name__ == "__main__":
    main()
