"""Variants scored side by side on a box with more GPUs than one engine needs: one vLLM engine
per group of tensor_parallel_size GPUs, each group taking the next variant as it frees up.

    groups = device_groups(visible_gpus(), tensor_parallel_size=2)   # [("0", "1"), ("2", "3"), ...]
    results = side_by_side(["w4", "int8", "nf4"], groups, work)      # work(name, group) -> result

One thread per group (the work is HTTP to the group's engine); the first error is raised once the
running variants finish. Several machines: vLLM's Ray backend (docs/methods/quality-vllm.md).
"""
from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

from pipeline.core.stage import StageError


def visible_gpus(listed: list[str] | None = None) -> list[str]:
    """The GPUs engines may use: `listed` (quality.vllm.devices), else CUDA_VISIBLE_DEVICES, else
    every GPU torch sees; [] without one."""
    if listed:
        return [str(d) for d in listed]
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def device_groups(devices: list[str], tensor_parallel_size: int) -> list[tuple[str, ...]]:
    """`devices` cut into groups of `tensor_parallel_size`, in order; GPUs left over are unused."""
    if devices and tensor_parallel_size > len(devices):
        raise StageError(f"quality.vllm.tensor_parallel_size {tensor_parallel_size} needs that many GPUs; "
                         f"this machine shows {len(devices)} ({', '.join(devices)})")
    n = len(devices) // tensor_parallel_size
    return [tuple(devices[i * tensor_parallel_size:(i + 1) * tensor_parallel_size]) for i in range(n)]


def groups_for(qcfg, host, budget, backends: dict, pending: list[str]) -> list[tuple[str, ...]]:
    """The GPU groups the pending variants are scored on side by side, or [] for one after
    another: vLLM scores them all, on GPUs, with no time budget (its looks are planned one variant
    at a time), and there is more than one group and more than one variant."""
    if host is None or host.platform == "cpu" or budget.active or len(pending) < 2:
        return []
    if any(backends[n].backend != "vllm" for n in pending):
        return []
    groups = device_groups(visible_gpus(qcfg.vllm.devices), qcfg.vllm.tensor_parallel_size)
    return groups if len(groups) > 1 else []


def side_by_side(names: list[str], groups: list[tuple[str, ...]], work) -> list:
    """work(name, group) for every name, at most one name per group at a time, as many at once as
    there are groups; the results in the order of `names`."""
    free: queue.Queue = queue.Queue()
    for g in groups:
        free.put(g)
    failed = threading.Event()

    def run(name: str):
        group = free.get()
        try:
            if failed.is_set():  # an earlier variant failed: start nothing new
                return None
            return work(name, group)
        except BaseException:
            failed.set()
            raise
        finally:
            free.put(group)

    with ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="gpu-group") as pool:
        futures = [pool.submit(run, n) for n in names]
        errors = [f.exception() for f in futures]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return [f.result() for f in futures]
