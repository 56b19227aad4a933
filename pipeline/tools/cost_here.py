"""The cost model's constants measured on this CPU (`estimate --device here`): the two numbers the
`cpu-2core` profile took from one machine, timed here on a randomly initialised float32 model of
the estimate's shape.

    from pipeline.tools.cost_here import measure
    from pipeline.tools.cost_model import SHAPES
    device, timed = measure(SHAPES["smollm2-135m"])

`step` is one decode step after CONTEXT cached positions (the bandwidth term), `token` one more
prefill row-token (the compute term), each the fastest of `reps` timings after a warm-up. GPTQ is
scaled by cpu-2core's FLOP/s over this CPU's; everything else is cpu-2core's. Why: the 2-core
machines this project runs on are not all alike (docs/methods/budget.md#the-estimate).
"""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import replace

import torch

from pipeline.tools.cost_devices import CPU_GPTQ_S, DEVICES, Device

CONTEXT = 64  # cached positions behind the timed decode step
PREFILL_ROWS, PREFILL_WIDTH = 4, 128  # the timed prefill call: 512 row-tokens


def _fastest(fn, reps: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def timings(config: dict, reps: int = 3) -> dict:
    """Seconds of a decode step and of one prefill row-token for a random float32 Llama of `config`."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**config)
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg).float().eval()
    vocab = cfg.vocab_size
    context = torch.randint(0, vocab, (1, CONTEXT))
    one = torch.randint(0, vocab, (1, 1))
    wide = torch.randint(0, vocab, (PREFILL_ROWS, PREFILL_WIDTH))
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values: renamed `cache` in newer transformers
        cache = DynamicCache(config=cfg)
        model(context, past_key_values=cache, use_cache=True)

        def step():
            model(one, past_key_values=cache, use_cache=True)
            cache.crop(-1)  # back to CONTEXT positions

        step_s = _fastest(step, reps)
        call_s = _fastest(lambda: model(one, use_cache=False), reps)
        wide_s = _fastest(lambda: model(wide, use_cache=False), reps)
    n = PREFILL_ROWS * PREFILL_WIDTH
    params = sum(p.numel() for p in model.parameters())
    return {"step_s": step_s, "call_s": call_s, "wide_s": wide_s, "token_s": max(wide_s - call_s, 1e-9) / (n - 1),
            "params": params, "fp32_bytes": 4 * params, "threads": torch.get_num_threads(),
            "cpus": os.cpu_count() or 1}


def device_from(t: dict) -> Device:
    """The `cpu-2core` profile with this CPU's step, token and GPTQ figures."""
    base = DEVICES["cpu-2core"]
    flops = 2 * t["params"] / t["token_s"]
    return replace(base, name="here", label=f"this CPU, measured ({t['threads']} threads)",
                   bandwidth=t["fp32_bytes"] / t["step_s"], flops=flops,
                   source=(f"measured here: a float32 decode step {t['step_s'] * 1e3:.1f} ms, a prefill row-token "
                           f"{t['token_s'] * 1e3:.2f} ms ({t['params'] / 1e6:.1f} M parameters, random weights); "
                           f"GPTQ scaled from cpu-2core by FLOP/s"),
                   gptq_cpu_s=CPU_GPTQ_S * base.flops / flops, cpus=t["cpus"])


def measure(shape_config: dict, reps: int = 3) -> tuple[Device, dict]:
    t = timings(shape_config, reps)
    return device_from(t), t
