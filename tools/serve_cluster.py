#!/usr/bin/env python3
"""N `tine serve` replicas behind sglang-router (cache-aware: a request goes to the replica that
already holds the longest prefix of its text), on one machine over loopback.

The commands it runs are the ones to put on N machines (or in a container orchestrator): one
`tine serve` per machine or GPU, and one router given every replica's URL. It prints them.

  python3 tools/serve_cluster.py --model M.gguf [--replicas 2] [--port 8080] [--base-port 8081]
      [--api-key KEY] [--policy cache_aware] [--tine target/release/tine]
      [--router-python PYTHON] [--tine-args '-np 2 --spec-type ngram'] [-- more router flags]

The router comes from PyPI (`sglang-router`, pinned below): with no --router-python, a venv is
made once under target/router-venv. Ctrl-C (or SIGTERM) stops the router and every replica.
A replica that exits is started again on its port; the router's health checks take it out of
rotation meanwhile and back once it answers. Standard library only.
"""

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request

ROUTER_PACKAGE = "sglang-router==0.3.2"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def router_python(given):
    if given:
        return given
    venv = os.path.join(ROOT, "target", "router-venv")
    py = os.path.join(venv, "bin", "python")
    check = [py, "-c", "import sglang_router"]
    if not os.path.exists(py) or subprocess.run(check, capture_output=True).returncode != 0:
        print(f"==> installing {ROUTER_PACKAGE} into {venv}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", ROUTER_PACKAGE], check=True)
    return py


def healthy(url, key, timeout=1.0):
    req = urllib.request.Request(url + "/health", headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def wait_healthy(url, key, seconds, proc=None, give_up=lambda: False):
    t0 = time.time()
    while time.time() - t0 < seconds and not give_up():
        if healthy(url, key):
            return True
        if proc is not None and proc.poll() is not None:
            return False
        time.sleep(0.2)
    return False


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080, help="the router's port")
    ap.add_argument("--base-port", type=int, default=8081, help="replica i listens on base-port + i")
    ap.add_argument("--api-key", help="required of clients by the router, and sent by it to the replicas")
    ap.add_argument("--policy", default="cache_aware", help="the router's policy (cache_aware, round_robin, random, power_of_two)")
    ap.add_argument("--tine", default=os.path.join(ROOT, "target", "release", "tine"))
    ap.add_argument("--tine-args", default="", help="more `tine serve` flags for every replica")
    ap.add_argument("--router-python", help="a python with sglang_router (default: target/router-venv, made on first use)")
    ap.add_argument("--health-interval", type=int, default=5, help="seconds between the router's health checks")
    ap.add_argument("--breaker-secs", type=int, default=10, help="how long the router's circuit breaker keeps a failing replica out before trying it again (its own default is 60)")
    ap.add_argument("router_args", nargs="*", help="more router flags, after --")
    a = ap.parse_args()

    key_args = ["--api-key", a.api_key] if a.api_key else []
    urls = [f"http://{a.host}:{a.base_port + i}" for i in range(a.replicas)]

    def replica_cmd(i):
        return [a.tine, "serve", "-m", a.model, "--host", a.host, "--port", str(a.base_port + i), *key_args, *shlex.split(a.tine_args)]

    py = router_python(a.router_python)
    router_cmd = [
        py, "-m", "sglang_router.launch_router", "--host", a.host, "--port", str(a.port), "--worker-urls", *urls,
        "--policy", a.policy, "--health-check-interval-secs", str(a.health_interval), "--cb-timeout-duration-secs", str(a.breaker_secs),
        "--prometheus-host", a.host, "--prometheus-port", str(a.port + 10000 if a.port < 55535 else a.port - 10000),
        *key_args, *a.router_args,
    ]
    procs = {}
    restarts = {}
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        for i in range(a.replicas):
            print("replica:", shlex.join(replica_cmd(i)), file=sys.stderr)
            procs[i] = subprocess.Popen(replica_cmd(i))
        for i, url in enumerate(urls):
            if not wait_healthy(url, a.api_key, 600, procs[i], lambda: stopping):
                sys.exit("stopped" if stopping else f"replica {i} ({url}) did not come up")
        print("router: ", shlex.join(router_cmd), file=sys.stderr)
        router = subprocess.Popen(router_cmd)
        if not wait_healthy(f"http://{a.host}:{a.port}", a.api_key, 120, router, lambda: stopping):
            sys.exit("stopped" if stopping else "the router did not come up")
        print(f"serving at http://{a.host}:{a.port} ({a.replicas} replicas, policy {a.policy})", file=sys.stderr, flush=True)
        while not stopping:
            if router.poll() is not None:
                sys.exit(f"the router exited ({router.returncode})")
            for i, p in procs.items():
                if p.poll() is not None and not stopping:
                    # Again at once, then waiting longer each time it keeps failing (up to a minute).
                    n, last = restarts.get(i, (0, 0.0))
                    n = 0 if time.time() - last > 120 else n
                    if time.time() - last < min(60, 2 ** n) - 1:
                        continue
                    print(f"replica {i} exited ({p.returncode}); starting it again", file=sys.stderr)
                    procs[i] = subprocess.Popen(replica_cmd(i))
                    restarts[i] = (n + 1, time.time())
            time.sleep(0.5)
    finally:
        everything = list(procs.values()) + ([router] if "router" in locals() else [])
        for p in everything:
            if p.poll() is None:
                p.terminate()
        for p in everything:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
