"""`quality.backend: vllm`: the quality slices scored through a vLLM engine specq serves.

    choice = vllm_backend.choose(cfg.quality, variant_dir, seed=cfg.seed)  # Choice("vllm", kwargs) or ("hf", why)
    engines = vllm_backend.Engines(host=vllm_backend.Host.of(cfg, log_dir))
    lm, load_seconds = engines.get(name, choice.kwargs)     # lm-eval's local-completions on a started server
    records, counters = evaluate(lm, lm.tokenizer, ...)     # the hf backend's records
    engines.release()                                       # every server stopped

`vllm_args` (pure: no vLLM needed) turns a variant directory into the engine's settings; a variant
vLLM cannot load falls back to hf or refuses the run (docs/methods/quality-vllm.md). On more GPUs
than one engine needs, the variants are scored side by side, one engine per group of
tensor_parallel_size GPUs (`groups_for`, `side_by_side`: one thread per group).
"""
from __future__ import annotations

import json
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.core.stage import StageError, read_json
from pipeline.vllm.spec_config import BITSANDBYTES, SCHEME_NOT_READ, eager, engine_env, method_reason, server_args

# Engine settings that say where or how long, never what is scored (left out of the lines' hash).
NOT_SCORED = ("pretrained", "tokenizer")
# A local-completions request that fails is retried this many times in all before the look fails.
CLIENT_TRIES = 2


def unavailable() -> str | None:
    """Why `backend: vllm` cannot run here (one line), or None where the vLLM environment runs."""
    from pipeline.vllm.env import unavailable as env_unavailable

    why = env_unavailable()
    return f"quality.backend vllm: {why} (or use quality.backend: hf)" if why else None


def platform() -> str:
    """"cpu" or "cuda": which build of vLLM the environment holds."""
    from pipeline.vllm.env import engine_info

    return engine_info().get("platform", "cuda")


def vllm_version() -> str | None:
    from pipeline.vllm.env import engine_info

    return engine_info().get("vllm")


def _quant_method(vdir: Path) -> str | None:
    from pipeline.variants.checkpoint import quant_config, quant_method

    return quant_method(quant_config(vdir))


def vllm_args(vdir: str | Path, meta: dict, vcfg, seed: int,
              supported: frozenset[str] | None = None, platform: str = "cuda") -> dict | str:
    """The engine settings for the variant in `vdir` (meta: its meta.json; vcfg: quality.vllm), or
    why vLLM cannot load it on `platform`. `supported`: the quantization methods vLLM lists."""
    vdir = Path(vdir)
    scheme = meta.get("scheme", "reference")
    if scheme in SCHEME_NOT_READ:
        return SCHEME_NOT_READ[scheme]
    if not any(vdir.glob("*.safetensors")) and not any(vdir.glob("*.bin")) and any(vdir.glob("*.gguf")):
        return "its weights are GGUF only (vLLM loads a single .gguf file, not a directory of them)"
    method = _quant_method(vdir)
    why = method_reason(method, supported, platform=platform)
    if why:
        return why
    # auto: the dtype the hf backend computes this variant in, so both backends compare like with like.
    dtype = vcfg.dtype
    if dtype == "auto" and meta.get("dtype_compute") in ("bfloat16", "float16", "float32"):
        dtype = meta["dtype_compute"]
    args = {"pretrained": str(vdir), "tokenizer": str(vdir), "dtype": dtype,
            "tensor_parallel_size": vcfg.tensor_parallel_size,
            "gpu_memory_utilization": vcfg.gpu_memory_utilization,
            "seed": seed, "batch_size": vcfg.batch_size}
    if vcfg.max_model_len is not None:
        args["max_model_len"] = vcfg.max_model_len
    if method == "bitsandbytes":
        args.update(BITSANDBYTES)
    return {**args, **vcfg.engine_args}


@dataclass(frozen=True)
class Choice:
    """What scores a variant: backend "vllm" with its engine settings, or "hf" (with why, when
    vLLM was asked for and cannot load it)."""
    backend: str
    kwargs: dict | None = None
    why: str | None = None
    quant_method: str | None = None
    vllm_version: str | None = None

    def scored_with(self) -> dict:
        """What the variant's lines were scored with (not the directory's path: a moved run is not re-scored)."""
        args = {k: v for k, v in (self.kwargs or {}).items() if k not in NOT_SCORED}
        return {"backend": self.backend, "why": self.why, "args": args, "vllm_version": self.vllm_version}

    def record(self, evaluator: str) -> dict:
        """What ran, for the variant's quality meta.json."""
        if self.backend == "vllm":
            return {"backend": "vllm", "evaluator": "vllm", "vllm_version": self.vllm_version,
                    "vllm_args": self.kwargs, "quant_method": self.quant_method}
        return {"backend": "hf", "evaluator": evaluator, **({"backend_reason": self.why} if self.why else {})}


def choose(qcfg, vdir: str | Path, seed: int, name: str | None = None, platform: str = "cuda",
           version: str | None = None) -> Choice:
    """hf when asked; vllm where vllm_args builds its settings; else hf with the reason
    (fallback: hf) or a StageError (fallback: stop)."""
    if qcfg.backend == "hf":
        return Choice("hf")
    vdir = Path(vdir)
    meta = read_json(vdir / "meta.json", "variant meta.json")
    args = vllm_args(vdir, meta, qcfg.vllm, seed, platform=platform)
    if isinstance(args, str):
        if qcfg.vllm.fallback == "stop":
            raise StageError(f"quality: vLLM cannot load variant '{name or vdir.name}': {args} "
                             "(quality.vllm.fallback: stop; fallback: hf scores it with transformers)")
        return Choice("hf", why=f"vLLM cannot load it: {args}")
    return Choice("vllm", kwargs=args, quant_method=_quant_method(vdir), vllm_version=version)


def config_reason(spec, platform: str = "cuda") -> str | None:
    """Why vLLM cannot load the variant quantize.variants.<name> makes, as far as the config and a
    checkpoint's config.json tell before quantize has run; None when it may."""
    if spec.scheme in SCHEME_NOT_READ:
        return SCHEME_NOT_READ[spec.scheme]
    if platform == "cpu" and spec.scheme in ("bnb-int8", "bnb-nf4"):
        return method_reason("bitsandbytes", platform=platform)
    if spec.scheme == "checkpoint" and spec.path:
        path = Path(spec.path).expanduser()
        if (path / "config.json").is_file():
            try:
                return method_reason(_quant_method(path), platform=platform)
            except (StageError, OSError, json.JSONDecodeError):
                return None  # quantize's own checks say what is wrong with the directory
    return None


# ---------------------------------------------------------------- engines (need the vLLM environment)


@dataclass(frozen=True)
class Host:
    """Where the engines run and how long to wait for them (the top-level `vllm` section)."""
    platform: str
    log_dir: Path
    enforce_eager: bool
    kv_cache_gib: float
    startup_timeout_s: float
    request_timeout_s: float
    devices: tuple[str, ...] | None = None  # the GPUs its engines see (CUDA_VISIBLE_DEVICES); None: all

    def on(self, devices: tuple[str, ...]) -> "Host":
        """The same host, its engines on `devices` only (side_by_side)."""
        return replace(self, devices=tuple(devices))

    @classmethod
    def of(cls, config, log_dir: Path) -> "Host":
        v, where = config.vllm, platform()
        return cls(platform=where, log_dir=Path(log_dir),
                   enforce_eager=eager(where, v.enforce_eager),
                   kv_cache_gib=v.kv_cache_gib, startup_timeout_s=v.startup_timeout_s,
                   request_timeout_s=v.request_timeout_s)


class Engines:
    """The engines started, one at a time: starting another stops the running one, but `keep` (the
    reference's, quality.vllm.keep_reference). `build(name, kwargs)` starts one (default: `serve`)."""

    def __init__(self, keep: str | None = None, build=None, host: Host | None = None):
        self.keep = keep
        self.loaded: dict[str, object] = {}
        self._build = build or (lambda name, kwargs: serve(name, kwargs, host))

    def get(self, name: str, kwargs: dict) -> tuple[object, float]:
        """(the lm-eval model of `name`, seconds spent starting it now: 0.0 when it was running)."""
        if name in self.loaded:
            return self.loaded[name], 0.0
        self.release(keep=self.keep)
        start = time.perf_counter()
        self.loaded[name] = self._build(name, kwargs)
        return self.loaded[name], time.perf_counter() - start

    def release(self, name: str | None = None, keep: str | None = None) -> None:
        """Stop engine `name` (None: every engine but `keep`)."""
        for n in [name] if name is not None else [n for n in self.loaded if n != keep]:
            lm = self.loaded.pop(n, None)
            if lm is not None:
                _shutdown(lm)

    def died(self, name: str) -> str | None:
        """One line when `name`'s engine is no longer serving (its log's last error), else None."""
        server = getattr(self.loaded.get(name), "server", None)
        if server is None or server.alive():
            return None
        from pipeline.vllm.server import last_error_line

        return f"its vLLM engine exited (log {server.log}: {last_error_line(server.log)})"


def _model_len(kwargs: dict) -> int:
    if kwargs.get("max_model_len"):
        return int(kwargs["max_model_len"])
    cfg = json.loads((Path(kwargs["pretrained"]) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    return int(text.get("max_position_embeddings") or text.get("n_positions") or 2048)


def serve(name: str, kwargs: dict, host: Host):
    """lm-eval's local-completions model on a vLLM server started on kwargs["pretrained"] (its
    `server`)."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from pipeline.quality import lm_tasks
    from pipeline.vllm.server import Server

    own = {"pretrained", "tokenizer", "dtype", "tensor_parallel_size", "gpu_memory_utilization", "seed",
           "batch_size", "max_model_len", *BITSANDBYTES}
    length = _model_len(kwargs)
    args = server_args(dtype=kwargs["dtype"], max_model_len=length, seed=kwargs["seed"], platform=host.platform,
                       enforce_eager=host.enforce_eager, max_num_seqs=max(8, int(kwargs["batch_size"])),
                       tensor_parallel_size=kwargs["tensor_parallel_size"],
                       gpu_memory_utilization=kwargs["gpu_memory_utilization"],
                       method="bitsandbytes" if "quantization" in kwargs else None,
                       extra={k: v for k, v in kwargs.items() if k not in own})
    env = engine_env(host.platform, host.kv_cache_gib)
    if host.devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(host.devices)
    server = Server(kwargs["pretrained"], args, host.log_dir / f"{name}.log", env=env,
                    startup_timeout_s=host.startup_timeout_s, name=f"quality {name}")
    server.__enter__()
    try:
        with lm_tasks.quiet():
            lm = LocalCompletionsAPI(base_url=f"{server.url}/v1/completions", model="specq",
                                     tokenizer=kwargs["tokenizer"], tokenizer_backend="huggingface",
                                     tokenized_requests=True, batch_size=int(kwargs["batch_size"]),
                                     max_length=length, seed=kwargs["seed"], max_retries=CLIENT_TRIES,
                                     timeout=int(host.request_timeout_s))
    except BaseException:
        server.__exit__(None, None, None)
        raise
    lm.server = server
    return lm


def _shutdown(lm) -> None:
    server = getattr(lm, "server", None)
    if server is not None:
        server.__exit__(None, None, None)


# ---------------------------------------------------------------- variants side by side


def visible_gpus(listed: list[str] | None = None) -> list[str]:
    """`listed` (quality.vllm.devices), else CUDA_VISIBLE_DEVICES, else every GPU torch sees."""
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
    another: side by side needs vLLM scoring them all on GPUs, no time budget, and more than one
    group and variant."""
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
