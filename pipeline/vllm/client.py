"""The HTTP side: one streamed completion per request, the /metrics counters, and load patterns.

    r = complete(url, {"prompt": ids, "max_tokens": 48, "temperature": 0.0})   # a Completion
    r.step_ids, r.spec   # the tokens of each engine step (prefill first); vLLM's speculative metrics

Each request streams with `continuous_usage_stats`, so every chunk is one engine step carrying its
token ids: steps, tokens per step and inter-token times come from the stream itself. Token ids go
in and come out, so nothing is re-tokenized.
"""
from __future__ import annotations

import http.client
import json
import random
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pipeline.core.stage import StageError


class EngineDied(StageError):
    """The engine stopped answering in the middle of a request (one line)."""


@dataclass
class Completion:
    """One streamed request: when each step's tokens arrived (seconds from sending) and what they were."""

    prompt_tokens: int
    step_times: list[float] = field(default_factory=list)  # [steps]: arrival of each step's chunk
    step_ids: list[list[int]] = field(default_factory=list)  # [steps][tokens of that step]
    logprobs: list[dict | None] = field(default_factory=list)  # per token: {"token", "logprob", "top": {id: lp}}
    finish_reason: str | None = None
    spec: dict | None = None  # metrics.speculative_decoding of the final chunk

    def to_json(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "step_times": self.step_times, "step_ids": self.step_ids,
                "finish_reason": self.finish_reason, "spec": self.spec}


def _token_id(key: str) -> int:
    """`return_tokens_as_token_ids` names tokens "token_id:123"."""
    return int(key.rsplit(":", 1)[-1])


def _read_logprobs(lp: dict | None, n: int) -> list[dict | None]:
    if not lp or not lp.get("tokens"):
        return [None] * n
    out = []
    for tok, val, top in zip(lp["tokens"], lp.get("token_logprobs") or [], lp.get("top_logprobs") or [{}] * n):
        out.append({"token": _token_id(tok), "logprob": val,
                    "top": {_token_id(k): v for k, v in (top or {}).items()}})
    return out


def complete(url: str, body: dict, timeout_s: float = 600.0, model: str = "specq") -> Completion:
    """Send one streamed completion and read it to the end."""
    body = {"model": model, "stream": True, "return_token_ids": True, "return_tokens_as_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **body}
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    out = Completion(prompt_tokens=len(body["prompt"]) if isinstance(body.get("prompt"), list) else 0)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            detail = resp.read().decode(errors="replace")[:300]
            raise StageError(f"vLLM answered {resp.status} to a completion: {detail}")
        finished = False
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                finished = True
                break
            chunk = json.loads(data)
            now = time.perf_counter() - t0
            if chunk.get("error"):
                err = chunk["error"]
                msg = (err.get("message") if isinstance(err, dict) else str(err)) or "unknown error"
                raise EngineDied(f"vLLM failed mid-request: {msg.splitlines()[0][:200]}")
            if chunk.get("metrics") and chunk["metrics"].get("speculative_decoding"):
                out.spec = chunk["metrics"]["speculative_decoding"]
            for choice in chunk.get("choices") or []:
                ids = choice.get("token_ids") or []
                if ids:
                    out.step_times.append(now)
                    out.step_ids.append(list(ids))
                    out.logprobs.extend(_read_logprobs(choice.get("logprobs"), len(ids)))
                if choice.get("finish_reason"):
                    out.finish_reason = choice["finish_reason"]
        if not finished:
            raise EngineDied("vLLM stopped answering mid-request (the stream ended before [DONE])")
    except (ConnectionError, http.client.HTTPException, TimeoutError, OSError) as e:
        raise EngineDied(f"vLLM stopped answering mid-request ({type(e).__name__}: {e})") from None
    finally:
        conn.close()
    if not out.step_ids:
        raise StageError("vLLM returned a completion with no tokens")
    return out


def parse_counters(text: str) -> dict:
    """vLLM's speculative-decoding counters from Prometheus text, summed over engines:
    {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos": [..]}."""
    out = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode_") or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        if not name.endswith("_total"):
            continue
        base = name.removeprefix("vllm:spec_decode_").removesuffix("_total")
        if base == "num_accepted_tokens_per_pos":
            pos = int(labels.split('position="')[1].split('"')[0])
            per_pos[pos] = per_pos.get(pos, 0.0) + float(value)
        elif base in out:
            out[base] += float(value)
    out["accepted_per_pos"] = [per_pos[i] for i in sorted(per_pos)]
    return out


def spec_counters(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        return parse_counters(r.read().decode())


def counter_delta(after: dict, before: dict) -> dict:
    n = max(len(after["accepted_per_pos"]), len(before["accepted_per_pos"]))
    pad = lambda xs: list(xs) + [0.0] * (n - len(xs))  # noqa: E731
    return {**{k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")},
            "accepted_per_pos": [a - b for a, b in zip(pad(after["accepted_per_pos"]), pad(before["accepted_per_pos"]))]}


def closed_loop(url: str, bodies: list[dict], concurrency: int, timeout_s: float = 600.0) -> tuple[list[Completion], float]:
    """Every body sent with `concurrency` in flight; the results in order, and the wall time."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(lambda b: complete(url, b, timeout_s), bodies))
    return results, time.perf_counter() - t0


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times (s from the start) of n requests at `rate` per second, exponential gaps."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def open_loop(url: str, bodies: list[dict], arrivals: list[float], timeout_s: float = 600.0,
              max_in_flight: int = 256) -> tuple[list[Completion | None], float]:
    """Each body sent at its arrival time, whatever is still running (queueing shows); a failed
    request is None. Returns the results and the wall time."""
    results: list[Completion | None] = [None] * len(bodies)
    t0 = time.perf_counter()

    def one(i: int) -> None:
        try:
            results[i] = complete(url, bodies[i], timeout_s)
        except StageError:
            results[i] = None
    with ThreadPoolExecutor(max_workers=max_in_flight) as pool:
        for i, at in enumerate(arrivals):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            pool.submit(one, i)
    return results, time.perf_counter() - t0

