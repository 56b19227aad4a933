"""Speculation measured in vLLM: one engine per (target, speculative config), driven over HTTP.

    from pipeline.latency.served import Settings, serve, measure, sampled_texts, open_loop_run
    with serve(settings, variant_dir, spec_config, log) as srv:          # pipeline.vllm.server.Server
        m = measure(srv.url, prompts, settings, k)                          # B = 1 and closed loops

`measure` sends every workload prompt once per temperature, one at a time (B = 1: per-request
times and accepted counts), then each closed loop, reading vLLM's /metrics counters around each
phase. The same prompts, temperatures and seeds run on the plain engine (spec None).
"""
from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.core.stage import StageError, read_json
from pipeline.speculation.engine_stats import latency_summary, request_record
from pipeline.speculation.measure import temp_key
from pipeline.vllm.client import closed_loop, complete, counter_delta, open_loop, poisson_arrivals, spec_counters
from pipeline.vllm.server import Server
from pipeline.vllm.spec_config import engine_env, server_args, target_reason

# Top logprobs asked for at temperature 0, for the greedy check's tie rule.
GREEDY_LOGPROBS = 5
# Tokens per sampled completion of the lossless test: positions 2..8 are each tested.
SAMPLED_TOKENS = 8
# What a closed loop's request records keep.
SLIM = ("id", "tokens", "steps", "drafts", "accepted", "ttft_ms", "tpot_ms", "decode_ms", "e2e_ms")


@dataclass
class Settings:
    """What every engine of a run shares (config `vllm`, resolved for this machine)."""
    platform: str  # "cpu" or "cuda"
    dtype: str
    max_model_len: int
    seed: int
    enforce_eager: bool
    max_num_seqs: int
    max_new_tokens: int
    temperatures: list[float]
    top_k: int = 0
    top_p: float = 1.0
    concurrency: list[int] = field(default_factory=list)
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    kv_cache_gib: float = 2.0
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    extra_args: dict = field(default_factory=dict)
    python: Path | None = None


def serve_reason(vdir: Path, platform: str) -> str | None:
    """Why vLLM cannot serve the variant in `vdir` on `platform` (one line), or None."""
    from pipeline.variants.checkpoint import quant_config, quant_method

    meta = read_json(vdir / "meta.json", "variant meta.json")
    try:
        method = quant_method(quant_config(vdir))
    except StageError as e:
        return str(e)
    weights = any(vdir.glob("*.safetensors")) or any(vdir.glob("*.bin"))
    return target_reason(meta.get("scheme", "reference"), method, platform, weights)


def serve(settings: Settings, vdir: Path, spec: dict | None, log: Path, name: str) -> Server:
    """A Server for `vdir` with speculative config `spec` (None: plain decoding); use it with `with`."""
    from pipeline.variants.checkpoint import quant_config, quant_method

    method = quant_method(quant_config(vdir))
    args = server_args(dtype=settings.dtype, max_model_len=settings.max_model_len, seed=settings.seed,
                       platform=settings.platform, enforce_eager=settings.enforce_eager,
                       max_num_seqs=settings.max_num_seqs, tensor_parallel_size=settings.tensor_parallel_size,
                       gpu_memory_utilization=settings.gpu_memory_utilization, method=method, spec=spec,
                       extra=settings.extra_args)
    env = engine_env(settings.platform, settings.kv_cache_gib)
    return Server(vdir, args, log, env=env, startup_timeout_s=settings.startup_timeout_s, python=settings.python,
                  name=name)


def body(settings: Settings, ids: list[int], temperature: float, seed: int, max_tokens: int | None = None,
         logprobs: bool = True) -> dict:
    out = {"prompt": list(ids), "max_tokens": max_tokens or settings.max_new_tokens, "temperature": temperature,
           "seed": seed}
    if settings.top_k:
        out["top_k"] = settings.top_k
    if settings.top_p < 1.0:
        out["top_p"] = settings.top_p
    if temperature == 0.0 and logprobs:
        out["logprobs"] = GREEDY_LOGPROBS
    return out


def _rows(prompts: dict) -> list[tuple[str, str, list[int]]]:
    """(category, prompt id, ids) for every prompt, categories taken in turn."""
    rows = [[(cat, pid, ids) for pid, ids in items] for cat, items in prompts.items()]
    return [r[i] for i in range(max(map(len, rows), default=0)) for r in rows if i < len(r)]


def b1_records(url: str, prompts: dict, settings: Settings, temperature: float, k: int, seed_base: int,
               progress=None) -> list[dict]:
    """Every workload prompt alone at `temperature` (B = 1): one record per request."""
    rows = _rows(prompts)
    tk = temp_key(temperature)
    recs = []
    for j, (cat, pid, ids) in enumerate(rows):
        comp = complete(url, body(settings, ids, temperature, seed_base + j), settings.request_timeout_s)
        recs.append({**request_record(pid, cat, comp.to_json(), k),
                     "logprobs": comp.logprobs if any(comp.logprobs) else None})
        if progress:
            progress(len(recs), len(rows), tk)
    return recs


def measure(url: str, prompts: dict, settings: Settings, k: int, progress=None) -> dict:
    """B = 1 over every prompt and temperature, then each closed loop; k = 0 for the plain engine."""
    rows = _rows(prompts)
    complete(url, body(settings, rows[0][2], 0.0, settings.seed, max_tokens=4), settings.request_timeout_s)  # warm-up
    out: dict = {"b1": {}, "closed_loop": {}, "counters": {}}
    for ti, t in enumerate(settings.temperatures):
        tk = temp_key(t)
        before = spec_counters(url)
        out["b1"][tk] = b1_records(url, prompts, settings, t, k, settings.seed * 1000 + ti * 100, progress)
        out["counters"][f"b1 T={tk}"] = counter_delta(spec_counters(url), before)
        for c in settings.concurrency:
            before = spec_counters(url)
            bodies = [body(settings, ids, t, settings.seed * 1000 + ti * 100 + j, logprobs=False)
                      for j, (_, _, ids) in enumerate(rows)]
            comps, wall = closed_loop(url, bodies, c, settings.request_timeout_s)
            recs_c = [request_record(pid, cat, x.to_json(), k) for (cat, pid, _), x in zip(rows, comps)]
            slim = [{key: r[key] for key in SLIM} for r in recs_c]
            out["closed_loop"].setdefault(str(c), {})[tk] = {"records": slim, **latency_summary(recs_c, wall)}
            out["counters"][f"B={c} T={tk}"] = counter_delta(spec_counters(url), before)
    return out


def sampled_texts(url: str, ids: list[int], samples: int, temperature: float, seed: int, tokens: int = SAMPLED_TOKENS,
                  timeout_s: float = 600.0) -> list[list[int]]:
    """`samples` sampled completions of one prompt, `tokens` tokens each (one request, n = samples):
    the lossless test's draws."""
    req = {"model": "specq", "prompt": list(ids), "n": samples, "max_tokens": tokens, "temperature": temperature,
           "seed": seed, "return_token_ids": True, "ignore_eos": True}
    r = urllib.request.Request(f"{url}/v1/completions", json.dumps(req).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(r, timeout=timeout_s) as resp:
        data = json.loads(resp.read())
    out = [list(c["token_ids"]) for c in data["choices"] if len(c.get("token_ids") or []) >= 2]
    if not out:
        raise StageError("vLLM returned no sampled completions for the lossless test")
    return out


def open_loop_run(url: str, prompts: dict, settings: Settings, rate: float, requests: int, seed: int,
                  slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    """Poisson arrivals at `rate` requests/s over the workload's prompts (cycled), at the first
    temperature: goodput at the SLO, TPOT p50 / p99, throughput; failed requests count against it."""
    rows = _rows(prompts)
    t = settings.temperatures[0]
    bodies = [body(settings, rows[i % len(rows)][2], t, seed * 7919 + i, logprobs=False) for i in range(requests)]
    comps, wall = open_loop(url, bodies, poisson_arrivals(requests, rate, seed), settings.request_timeout_s)
    ok = [c for c in comps if c is not None]
    recs = [request_record(str(i), "open", c.to_json(), 0) for i, c in enumerate(ok)]
    good = sum(1 for r in recs if r["ttft_ms"] <= slo_ttft_ms and (r["tpot_ms"] is None or r["tpot_ms"] <= slo_tpot_ms))
    summary = latency_summary(recs, wall)
    return {"rate": rate, "requests": requests, "failed": requests - len(ok), "wall_s": wall,
            "goodput_rps": good / wall if wall > 0 else 0.0, "slo_met": good,
            "tpot_ms": summary["tpot_ms"], "ttft_ms": summary["ttft_ms"],
            "tpot_per_request_ms": [r["tpot_ms"] for r in recs if r["tpot_ms"] is not None],
            "output_tokens_per_s": summary.get("output_tokens_per_s")}

