#!/usr/bin/env python3
"""Whether two builds send the same thing upstream: every recorded request, explained by both.

    python3 bench/explain_ab.py OLD_BIN NEW_BIN            # every data file (under a minute)
    python3 bench/explain_ab.py OLD_BIN NEW_BIN --limit 50 # the first 50 requests of each

A change meant to make the proxy faster must leave what it sends as it was (issue 34: "outputs
byte-identical"). This starts `ctxproxy serve` from each binary (config.toml, memory store, an
upstream that is never called) and sends every request of every data file in ../shared/data
($DATA) to `POST /v1/ctxproxy/explain` on both, in the same order, so each process carries the
same state from request to request (a sticky replica's: what it memoized of a conversation
shapes the next turn's rewrite). The order: every file as recorded, then each file as Responses
API bodies (../shared/tools/convert_responses.py; tau2 dev also with --reasoning), then the tau2
dev, MCP agent and airline files reversed (each conversation's later turns before its earlier
ones: a replica that never saw the start). Each answer (the request as it would be sent, and
every stage's report) is compared byte for byte.

Prints the number of answers and of those that differ, and the first differences (the request,
the JSON path, both values); exits 1 when any differs, 2 when a process fails.
"""
import argparse
import http.client
import json
import os
import subprocess
import sys
import shutil
import tempfile

from procs import fail, free_port, wait_ready

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.environ.get("DATA") or os.path.join(ROOT, "..", "shared", "data")
CONVERT = os.path.join(ROOT, "..", "shared", "tools", "convert_responses.py")
CONFIG = os.environ.get("BENCH_CONFIG") or os.path.join(ROOT, "config.toml")
REVERSED = ["tau2_bench_dev.jsonl", "mcpmark_mcp_agent_trajectories.jsonl",
            "tau_bench_airline_gpt4o.jsonl"]


def start(binary, logdir, name):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTXPROXY_")}
    env.update(CTXPROXY_UPSTREAM_BASE_URL=f"http://127.0.0.1:{free_port()}/v1",
               CTXPROXY_STORE_BACKEND="memory", CTXPROXY_LOG_LEVEL="warn")
    with open(os.path.join(logdir, f"{name}.log"), "w") as log:
        proc = subprocess.Popen([binary, "serve", "--config", CONFIG, "--listen",
                                 f"127.0.0.1:{port}"], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    return proc, port


def explain(conn, body):
    """The status and bytes of the explain answer; one retry on a connection the server closed
    while idle (a file converted between two requests)."""
    for attempt in (0, 1):
        try:
            conn.request("POST", "/v1/ctxproxy/explain", body=body,
                         headers={"Content-Type": "application/json"})
            answer = conn.getresponse()
            return answer.status, answer.read()
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
            conn.close()
            if attempt:
                raise
    raise AssertionError("unreachable")


def parsed(data):
    try:
        return json.loads(data)
    except ValueError:
        return data.decode("utf-8", "replace")


def first_difference(a, b, path="$"):
    if type(a) is not type(b):
        return path, a, b
    if isinstance(a, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{path}.{key}", a.get(key, "<absent>"), b.get(key, "<absent>")
            found = first_difference(a[key], b[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}.length", len(a), len(b)
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if a == b else (path, a, b)


def lines(path, limit, reverse=False):
    with open(path, "rb") as f:
        rows = [line for line in f if line.strip()]
    rows = rows[:limit] if limit else rows
    return rows[::-1] if reverse else rows


def sources(workdir, limit):
    """(label, request bodies) in the order both processes get them."""
    names = sorted(n for n in os.listdir(DATA)
                   if n.endswith(".jsonl") and not n.endswith(".meta.jsonl"))
    if not names:
        fail(f"no data files in {DATA}")
    for name in names:
        yield name, lines(os.path.join(DATA, name), limit)
    for name in names:
        for extra in ([], ["--reasoning"]) if name == "tau2_bench_dev.jsonl" else ([],):
            out = os.path.join(workdir, f"responses{''.join(extra)}-{name}")
            subprocess.run([sys.executable, CONVERT, os.path.join(DATA, name), out, *extra],
                           check=True, stdout=subprocess.DEVNULL)
            yield f"{name} as Responses {' '.join(extra)}".strip(), lines(out, limit)
    for name in REVERSED:
        if name in names:
            yield f"{name} reversed", lines(os.path.join(DATA, name), limit, reverse=True)


def stop(proc):
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--limit", type=int, default=0, help="the first N requests of each file")
    parser.add_argument("--show", type=int, default=5, help="differences printed")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="explain-ab-")
    procs = []
    answers = differ = 0
    try:
        for binary, name in ((args.old, "old"), (args.new, "new")):
            proc, port = start(binary, workdir, name)
            procs.append((proc, port))
            wait_ready(port, "/healthz", proc, f"{name} ({binary})")
        conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=300)
                 for _, port in procs]
        for label, bodies in sources(workdir, args.limit):
            file_differ = 0
            for index, body in enumerate(bodies):
                (old_status, old), (new_status, new) = (
                    explain(conn, body) for conn in conns)
                answers += 1
                if (old_status, old) == (new_status, new):
                    continue
                differ += 1
                file_differ += 1
                if differ <= args.show:
                    found = first_difference([old_status, parsed(old)], [new_status, parsed(new)])
                    path, a, b = found or ("$ (bytes only: the same JSON written otherwise)",
                                           len(old), len(new))
                    print(f"  {label} #{index}: {path}: {json.dumps(a)[:200]} "
                          f"-> {json.dumps(b)[:200]}")
            print(f"{label}: {len(bodies)} answers, {file_differ} differ", flush=True)
    except (OSError, http.client.HTTPException, subprocess.CalledProcessError) as error:
        exited = [p.returncode for p, _ in procs if p.poll() is not None]
        fail(f"{error!r} (proxies exited: {exited}; logs in {workdir})")
    finally:
        for proc, _ in procs:
            stop(proc)
    shutil.rmtree(workdir, ignore_errors=True)
    print(f"{answers} explain answers, {differ} differ")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
