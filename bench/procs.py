"""What the bench scripts share to run ctxproxy and its mock beside them: a free loopback
port, and waiting until a started process answers (exit 2 when it dies or never answers)."""

import http.client
import socket
import sys
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port, path, proc, name="process", tries=300):
    """Returns once GET `path` on 127.0.0.1:`port` answers 200; `proc` is the process started."""
    for _ in range(tries):
        if proc.poll() is not None:
            fail(f"{name} on port {port} exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", path)
            ok = conn.getresponse().status == 200
            conn.close()
            if ok:
                return
        except OSError:
            pass
        time.sleep(0.1)
    fail(f"{name} does not answer on 127.0.0.1:{port}{path}")


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
