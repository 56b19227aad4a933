"""The bench's clocks (pipeline/tools/bench.py): model forwards timed inside a run, where the host's
share of a run goes, and the paired repeats of two sides back to back.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager


@contextmanager
def forward_clock(modules: dict):
    """Time every forward of each module (label -> module) and note the cache class it was handed:
    {label: {"calls", "seconds", "caches"}}."""
    stats = {label: {"calls": 0, "seconds": 0.0, "caches": set()} for label in modules}

    def wrap(label, fn):
        def timed(*args, **kwargs):
            s = stats[label]
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            if cache is not None:
                s["caches"].add(type(cache).__name__)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                s["calls"] += 1
                s["seconds"] += time.perf_counter() - t0
        return timed

    for label, m in modules.items():
        m.forward = wrap(label, m.forward)  # instance attribute: shadows the class's forward
    try:
        yield stats
    finally:
        for m in modules.values():
            m.__dict__.pop("forward", None)
        for s in stats.values():
            s["caches"] = sorted(s["caches"])


def profiled(fn, modules: dict, device) -> dict:
    """One untimed run of fn with its model forwards clocked: total, forward and host seconds."""
    from pipeline.decode.timing import synchronize

    with forward_clock(modules) as stats:
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        total = time.perf_counter() - t0
    fwd = sum(s["seconds"] for s in stats.values())
    return {"total_s": total, "forward_s": fwd, "host_s": total - fwd,
            "host_share": (total - fwd) / total if total > 0 else None, "forwards": stats}


def paired_runs(sides: dict, device, warmup: int, repeats: int, label: str) -> dict:
    """sides: {"engine": fn, "transformers": fn}, each returning its tokens. Every side's runs:
    `warmup` untimed, then `repeats` timed, the two sides back to back per repeat, order
    alternating (paired_ratio.run_order). Returns the seconds and last tokens per side."""
    from pipeline.decode.timing import synchronize
    from pipeline.tools.paired_ratio import run_order

    for _ in range(warmup):
        for fn in sides.values():
            fn()
    seconds = {name: [] for name in sides}
    tokens = {}
    for r in range(repeats):
        times = {}
        for name in run_order(r, tuple(sides)):
            synchronize(device)
            t0 = time.perf_counter()
            tokens[name] = sides[name]()
            synchronize(device)
            times[name] = time.perf_counter() - t0
            seconds[name].append(times[name])
        e, h = times["engine"], times["transformers"]
        print(f"bench: {label}: repeat {r + 1}/{repeats}: engine {e:.2f} s, transformers {h:.2f} s "
              f"({h / e:.2f}x)", file=sys.stderr, flush=True)
    return {"seconds": seconds, "tokens": tokens}

