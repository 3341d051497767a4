#!/usr/bin/env python3
"""Every request a file of conversation snapshots implies, in order, for the bill with the
provider's prompt cache (`../shared/tools/cache_cost.py`, `bench/cost.sh`).

    python3 bench/every_turn.py mcpmark_postgres_dev.jsonl target/every/mcpmark_postgres_dev.jsonl
    python3 ../shared/tools/cache_cost.py http://127.0.0.1:8090 target/every/mcpmark_postgres_dev.jsonl

A snapshot file (MCPMark, tau2 dev) holds a few requests of each conversation, so consecutive
lines of one conversation are far apart and the cache model sees almost no shared prefix. This
takes each conversation's longest snapshot (by its `conversation` in FILE.meta.jsonl) and writes
the requests its history shows, as `ctxproxy`'s prefix replay names them: the messages before
each assistant message that follows a user turn and another message, then the snapshot itself.
Beside OUT it writes OUT's meta file (`conversation` per line), which both tools read, with
`response_tool_names`: the tools the answer to each request called, read from the assistant
message that follows it in the history (the snapshot's own from its meta line), so that
`bench/cost.sh` bills the re-asks of calls to stubs on these files too. The
requests are the client's own messages, cut; nothing is invented. Files are names in $DATA
(../shared/data) or paths; read by path, never copied into the repository.
"""
import json
import os
import sys

DATA = os.environ.get("DATA", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data"))


def lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def cuts(messages):
    """The lengths of the requests a history shows, the whole history last."""
    seen_user, out = False, []
    for i, message in enumerate(messages):
        after_other = i > 0 and messages[i - 1]["role"] != "assistant"
        if seen_user and after_other and message["role"] == "assistant":
            out.append(i)
        seen_user |= message["role"] == "user"
    return out + [len(messages)]


def called(messages, length, recorded):
    """The tools the answer to the request of the first `length` messages called."""
    if length == len(messages):
        return recorded.get("response_tool_names") or []
    calls = messages[length].get("tool_calls") or []
    return [c.get("function", {}).get("name") for c in calls if c.get("function", {}).get("name")]


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    source = sys.argv[1] if os.path.exists(sys.argv[1]) else os.path.join(DATA, sys.argv[1])
    out = sys.argv[2]
    bodies = lines(source)
    metas = lines(source[: -len(".jsonl")] + ".meta.jsonl")
    if len(metas) != len(bodies):
        sys.exit(f"{source}: {len(bodies)} requests but {len(metas)} meta lines")
    longest = {}
    for body, meta in zip(bodies, metas):
        key = meta["conversation"]
        if key not in longest or len(body["messages"]) > len(longest[key][0]["messages"]):
            longest[key] = (body, meta)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    written = 0
    with open(out, "w") as requests, open(out[: -len(".jsonl")] + ".meta.jsonl", "w") as meta:
        for key, (body, recorded) in longest.items():
            messages = body["messages"]
            for length in cuts(messages):
                requests.write(json.dumps(dict(body, messages=messages[:length])) + "\n")
                meta.write(json.dumps({"conversation": key, "response_tool_names": called(messages, length, recorded)}) + "\n")
                written += 1
    print(f"{out}: {written} requests of {len(longest)} conversations")


if __name__ == "__main__":
    main()
