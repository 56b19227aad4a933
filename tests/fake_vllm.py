"""A stand-in for `python -m vllm.entrypoints.openai.api_server`, for the server life-cycle tests.

write_fake_vllm(dir) lays out a package `vllm.entrypoints.openai.api_server` under dir; run with
PYTHONPATH=dir it starts a child process (as vLLM starts its engine core), records both pids in
$FAKE_VLLM_PIDS, and serves /health, /metrics and a streamed /v1/completions shaped like vLLM's
(each step's token ids, continuous usage, per-request speculative metrics in the last chunk).
$FAKE_VLLM_MODE: ok, crash (exits with an error line), hang (never answers /health), die (the
engine dies after the first streamed chunk).
"""
from __future__ import annotations

from pathlib import Path

SERVER = r'''
import argparse, json, os, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser()
p.add_argument("--model"); p.add_argument("--host"); p.add_argument("--port", type=int)
p.add_argument("--speculative-config", default=None)
args, _ = p.parse_known_args()
mode = os.environ.get("FAKE_VLLM_MODE", "ok")
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(os.environ["FAKE_VLLM_PIDS"], "a") as fh:
    fh.write(f"{os.getpid()} {child.pid}\n")
print(f"fake vllm on port {args.port}", flush=True)
if mode == "crash":
    print("ValueError: the model config is not one this fake reads", flush=True)
    sys.exit(1)
if mode == "hang":
    time.sleep(600)
k = json.loads(args.speculative_config)["num_speculative_tokens"] if args.speculative_config else 0
STATE = {"drafts": 0, "accepted": [0] * k}

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        if self.path == "/health":
            body = b"ok"
        elif self.path == "/metrics":
            lines = [f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="specq"}} {STATE["drafts"]}.0']
            lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="specq",position="{i}"}} {a}.0'
                      for i, a in enumerate(STATE["accepted"])]
            body = ("\n".join(lines) + "\n").encode()
        else:
            self.send_response(404); self.end_headers(); return
        self.send_response(200); self.end_headers(); self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = req["max_tokens"]
        # steps: the prefill's token, then steps of 1 + accepted tokens (accepted cycles 0..k)
        steps, acc, left, j = [[7]], [], n - 1, 0
        while left > 0:
            a = min(j % (k + 1), left - 1) if k else 0
            steps.append([8 + i for i in range(a + 1)]); acc.append(a); left -= a + 1; j += 1
        if k:
            STATE["drafts"] += len(acc)
            for a in acc:
                for i in range(a):
                    STATE["accepted"][i] += 1
        self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
        done = 0
        for i, ids in enumerate(steps):
            done += len(ids)
            chunk = {"choices": [{"index": 0, "token_ids": ids, "finish_reason": "length" if i == len(steps) - 1 else None,
                                  "logprobs": None}], "usage": {"completion_tokens": done}}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n"); self.wfile.flush()
            if mode == "die":
                child.kill(); os._exit(1)
            time.sleep(0.002)
        if k:
            spec = {"per_step_accepted": acc, "per_step_drafted": [k] * len(acc), "num_spec_steps": len(acc)}
            self.wfile.write(b"data: " + json.dumps({"choices": [], "metrics": {"speculative_decoding": spec}}).encode()
                             + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")

ThreadingHTTPServer((args.host, args.port), H).serve_forever()
'''


def write_fake_vllm(root: Path) -> Path:
    pkg = root / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True, exist_ok=True)
    for d in (root / "vllm", root / "vllm" / "entrypoints", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(SERVER)
    return root
