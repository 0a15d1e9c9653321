#!/usr/bin/env python3
"""llama-server's own test suite (`tools/server/tests/unit` of the llama.cpp sources vendored in
the `llama-cpp-python` sdist on PyPI) run against `tine serve`.

    python3 tools/llama_server_suite.py [--tine target/release/tine] [--model GGUF]
        [--files test_basic.py,test_completion.py,...] [--out docs/evaluations/llama-server-suite/report.md]

The suite starts `llama-server` with its own flags and models from a model hub; here it starts
a shim instead (`LLAMA_SERVER_BIN_PATH`), which runs `tine serve` on one GGUF (default: the
cached Gemma 3 270M Q4_K_M) with the flags Tine shares with llama-server, and drops the rest
(threads, GPU layers, flash attention, LoRA, hub downloads: each dropped flag is printed in the
server's log). So tests that read their own models' text, or features Tine does not have
(reranking, multimodal, LoRA, router mode, MCP), fail here for reasons that are not
differences in the API; the report lists every test with its outcome so they can be told apart.

Needs pytest and the suite's requirements, installed once into `target/llama-suite-venv`
(PyPI). Every test has a time limit (pytest-timeout, 120 s). Writes a Markdown report.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSION = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")
CACHE = Path(os.environ.get("TINE_PEERS_DIR", Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tine-peers"))
VENV = ROOT / "target" / "llama-suite-venv"
PACKAGES = ["pytest==8.3.5", "pytest-timeout==2.3.1", "requests==2.32.3", "wget==3.2", "aiohttp==3.9.5", "numpy==2.2.6", "openai==2.14.0", "prometheus-client==0.20.0", "filelock==3.16.1"]

# The flags the shim hands to `tine serve` as they are (with a value, or alone).
WITH_VALUE = {"--port", "--temp", "--seed", "--host", "--cors-origins", "--batch-size", "--ubatch-size", "--pooling", "--alias", "--tags", "--ctx-size", "--parallel", "-ctk", "-ctv",
              "--n-predict", "--slot-save-path", "--spec-type", "--api-key", "--spec-draft-n-max", "--spec-draft-n-min", "--reasoning-format", "--reasoning", "--chat-template",
              "--chat-template-file", "--cache-ram"}
ALONE = {"--metrics", "--no-slots", "--context-shift", "--jinja", "--verbose"}
RENAMED = {"--embedding": "--embeddings", "--no-ui": "--no-webui"}
# llama-server flags Tine does not take, and whether they carry a value.
DROPPED_WITH_VALUE = {"--hf-repo", "--hf-file", "--model", "--model-url", "--model-draft", "--threads", "--n-gpu-layers", "-fa", "--grp-attn-n", "--grp-attn-w", "--lora", "--spec-synth-len",
                      "--spec-synth-rates", "--models-dir", "--models-max", "--models-preset", "--mmproj-url", "--media-path", "--sleep-idle-seconds", "--tools", "--tools-runtime",
                      "--mcp-servers-config", "--mcp-servers-json"}

SHIM = r'''#!PYTHON
# llama-server's command line -> `tine serve` (written by tools/llama_server_suite.py).
import os, sys
TINE, MODEL = TINE_PATH, MODEL_PATH
WITH_VALUE, ALONE, RENAMED, DROPPED_WITH_VALUE = WITH_VALUE_SET, ALONE_SET, RENAMED_MAP, DROPPED_SET
args, out, dropped, i = sys.argv[1:], ["serve", "-m", MODEL], [], 0
while i < len(args):
    a = args[i]
    if a in WITH_VALUE and i + 1 < len(args):
        out += [a, args[i + 1]]; i += 2
    elif a in ALONE:
        out.append(a); i += 1
    elif a in RENAMED:
        out.append(RENAMED[a]); i += 1
    elif a in DROPPED_WITH_VALUE and i + 1 < len(args):
        dropped += [a, args[i + 1]]; i += 2
    else:
        dropped.append(a); i += 1
print("shim: tine " + " ".join(out), flush=True)
print("shim: dropped " + " ".join(dropped), flush=True)
os.execv(TINE, [TINE] + out)
'''


def suite_dir() -> Path:
    src = CACHE / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp" / "tools" / "server" / "tests"
    if not src.is_dir():
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python", f"llama-cpp-python=={VERSION}", "-d", str(CACHE)], check=True)
        with tarfile.open(CACHE / f"llama_cpp_python-{VERSION}.tar.gz") as t:
            t.extractall(CACHE, filter="data")
    return src


def venv_python() -> Path:
    py = VENV / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    ok = subprocess.run([str(py), "-c", "import pytest, pytest_timeout, requests, wget, aiohttp, numpy, openai, prometheus_client"], capture_output=True).returncode == 0
    if not ok:
        subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *PACKAGES], check=True)
    return py


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tine", default=str(ROOT / "target" / "release" / "tine"))
    ap.add_argument("--model", default=str(Path(os.environ.get("TINE_CACHE_DIR", Path.home() / ".cache" / "tine")) / "models" / "gemma-3-270m-q4_k_m.gguf"))
    ap.add_argument("--files", default="test_basic.py,test_chat_completion.py,test_completion.py,test_ctx_shift.py,test_infill.py,test_metrics.py,test_security.py,test_slot_save.py,"
                                        "test_speculative.py,test_template.py,test_tokenize.py,test_embedding.py,test_ignore_eos.py")
    ap.add_argument("--out", default=str(ROOT / "docs" / "evaluations" / "llama-server-suite" / "report.md"))
    ap.add_argument("-k", default=None, help="pytest's -k, to run some tests only")
    a = ap.parse_args()
    tests = suite_dir()
    py = venv_python()
    # The suite runs where it lies (its tests read `../../../models/templates/*.jinja`); the shim,
    # the log and the servers' cache go under target/.
    work = ROOT / "target" / "llama-suite"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    shim = work / "llama-server-shim"
    text = SHIM.replace("#!PYTHON", "#!" + sys.executable).replace("TINE_PATH", repr(str(Path(a.tine).resolve()))).replace("MODEL_PATH", repr(a.model))
    text = text.replace("WITH_VALUE_SET", repr(WITH_VALUE)).replace("ALONE_SET", repr(ALONE)).replace("RENAMED_MAP", repr(RENAMED)).replace("DROPPED_SET", repr(DROPPED_WITH_VALUE))
    shim.write_text(text)
    shim.chmod(0o755)
    files = [f.strip() for f in a.files.split(",") if f.strip()]
    cmd = [str(py), "-m", "pytest", "-p", "no:cacheprovider", "-rA", "--timeout=120", "-o", "addopts=", *[f"unit/{f}" for f in files]]
    if a.k:
        cmd += ["-k", a.k]
    env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(shim), "LLAMA_CACHE": str(work / "cache")}
    print("running:", " ".join(cmd), flush=True)
    run = subprocess.run(cmd, cwd=tests, env=env, capture_output=True, text=True)
    log = work / "pytest.log"
    log.write_text(run.stdout + run.stderr)
    outcomes = {}
    for line in run.stdout.splitlines():
        m = re.match(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (unit/\S+?)(?: - (.*))?$", line)
        if m:
            outcomes[m.group(2)] = (m.group(1), (m.group(3) or "")[:160])
    per_file = {}
    for test, (outcome, _) in outcomes.items():
        f = test.split("::")[0].removeprefix("unit/")
        per_file.setdefault(f, {}).setdefault(outcome, 0)
        per_file[f][outcome] += 1
    total = {k: sum(d.get(k, 0) for d in per_file.values()) for k in ["PASSED", "FAILED", "ERROR", "SKIPPED"]}
    lines = [
        "# llama-server's test suite against `tine serve`",
        "",
        f"llama.cpp's `tools/server/tests` from the `llama-cpp-python` {VERSION} sdist, run against `tine serve` over",
        f"`{Path(a.model).name}` through a flag shim (`tools/llama_server_suite.py`; the suite's models swapped for this one,",
        "flags Tine does not take dropped). Command:",
        "",
        "```",
        f"python3 tools/llama_server_suite.py --files {','.join(files)}" + (f" -k '{a.k}'" if a.k else ""),
        "```",
        "",
        f"**{total['PASSED']} passed, {total['FAILED'] + total['ERROR']} failed**, {total['SKIPPED']} skipped, of {sum(total.values())}.",
        "",
        "| file | passed | failed | skipped |",
        "|---|---|---|---|",
    ]
    for f in sorted(per_file):
        d = per_file[f]
        lines.append(f"| {f} | {d.get('PASSED', 0)} | {d.get('FAILED', 0) + d.get('ERROR', 0)} | {d.get('SKIPPED', 0)} |")
    lines += ["", "Every test and its outcome (a failure's first line of reason):", "", "| test | outcome | reason |", "|---|---|---|"]
    for test in sorted(outcomes):
        outcome, why = outcomes[test]
        lines.append(f"| `{test.removeprefix('unit/')}` | {outcome} | {why.replace('|', '/')} |")
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(f"{total['PASSED']} passed, {total['FAILED'] + total['ERROR']} failed, {total['SKIPPED']} skipped; report: {a.out}; log: {log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
