"""What vLLM is given: the server's flags for a target, the `speculative_config` for a draft and k,
and the `vllm serve` line a user deploys with.

    why = target_reason(scheme, quant_method, platform="cpu")     # None, or why vLLM cannot load it
    spec = speculative_config("ngram", 3, run_dir)                 # {"method": "ngram", ...}, or why none

Draft kinds -> vLLM methods: ngram[:<max_n>] -> "ngram" (prompt lookup 1..max_n, default 3);
self:<variant> and hf:<path or id> -> "draft_model"; eagle3:<dir> -> "eagle3"; layerskip: none.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

# config.json quant_method values vLLM reads (its QUANTIZATION_METHODS, 0.6 to 0.32).
VLLM_METHODS = frozenset({
    "awq", "awq_marlin", "gptq", "gptq_marlin", "gptq_marlin_24", "gptq_bitblas", "marlin", "bitblas",
    "fp8", "fbgemm_fp8", "ptpc_fp8", "compressed-tensors", "bitsandbytes", "modelopt", "modelopt_fp4",
    "experts_int8", "hqq", "quark", "moe_wna16", "auto-round", "mxfp4", "deepspeedfp", "gguf",
})
# What vLLM's CPU backend runs (its CPU docs: GPTQ, AWQ, W8A8 INT8 through compressed-tensors).
CPU_METHODS = frozenset({"gptq", "gptq_marlin", "awq", "awq_marlin", "compressed-tensors"})

# Methods vLLM lists but does not read in the form specq's variants are written in.
NOT_READ = {
    "torchao": "torchao tensors saved by transformers' save_pretrained (safetensors) are not a "
               "checkpoint format vLLM loads",
}
# Schemes (meta.json `scheme`) whose directories vLLM does not read, whatever their config says.
SCHEME_NOT_READ = {"torchao-int8wo": "scheme torchao-int8wo: " + NOT_READ["torchao"]}
BITSANDBYTES = {"quantization": "bitsandbytes", "load_format": "bitsandbytes"}

NO_COUNTERPART = {"layerskip": "vLLM has no layer-skip self-draft (its figures are the specq engine's)"}
KINDS = ("ngram", "self", "hf", "eagle3")
NGRAM_MIN, NGRAM_MAX = 1, 3


def method_reason(method: str | None, supported: frozenset[str] | None = None, platform: str = "cuda") -> str | None:
    """None when vLLM reads checkpoints quantized with `method` (None = unquantized), else why not."""
    if method is None or method in NOT_READ:
        return NOT_READ.get(method)
    if method not in (VLLM_METHODS if supported is None else supported):
        return f"quantization method '{method}' is not one vLLM reads"
    if platform == "cpu" and method not in CPU_METHODS:
        return (f"vLLM's CPU backend does not run '{method}' checkpoints (it runs "
                f"{', '.join(sorted(CPU_METHODS))})")
    return None


def target_reason(scheme: str, method: str | None, platform: str, has_safetensors: bool = True) -> str | None:
    """Why vLLM cannot serve a variant directory (its meta.json's scheme, config.json's method), or None."""
    if scheme in SCHEME_NOT_READ:
        return SCHEME_NOT_READ[scheme]
    if not has_safetensors:
        return "its weights are not safetensors or .bin files vLLM loads"
    return method_reason(method, platform=platform)


def eager(platform: str, enforce_eager: bool | None) -> bool:
    """CUDA graphs off: as configured, or (null) on CPU only, where vLLM compiles nothing useful."""
    return (platform == "cpu") if enforce_eager is None else enforce_eager


def engine_env(platform: str, kv_cache_gib: float) -> dict[str, str]:
    """The environment an engine needs beyond specq's: its KV cache size on CPU."""
    return {"VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}"} if platform == "cpu" else {}


def server_args(*, dtype: str, max_model_len: int, seed: int, platform: str, enforce_eager: bool,
                max_num_seqs: int, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.9,
                method: str | None = None, spec: dict | None = None, extra: dict | None = None) -> list[str]:
    """The api_server flags after --model (with `spec`, per-request speculative metrics on)."""
    # Prefix caching off: a prompt cached by an earlier phase would report a TTFT without its prefill.
    args = ["--served-model-name", "specq", "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--seed", str(seed), "--max-num-seqs", str(max_num_seqs), "--disable-uvicorn-access-log",
            "--no-enable-prefix-caching"]
    if enforce_eager:
        args.append("--enforce-eager")
    if platform != "cpu":
        args += ["--tensor-parallel-size", str(tensor_parallel_size),
                 "--gpu-memory-utilization", str(gpu_memory_utilization)]
    if method == "bitsandbytes":
        args += ["--quantization", "bitsandbytes", "--load-format", "bitsandbytes"]
    if spec:  # vLLM refuses per-request metrics without speculation
        args += ["--speculative-config", json.dumps(spec, sort_keys=True),
                 "--per-request-spec-decode-metrics", "detailed"]
    for key, value in (extra or {}).items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value not in (False, None):
            args += [flag, str(value)]
    return args


def draft_method(spec: str, run_dir: Path | None) -> dict | str:
    """The speculative_config without k for a draft spec, or why vLLM has none."""
    kind, _, arg = spec.partition(":")
    if kind in NO_COUNTERPART:
        return NO_COUNTERPART[kind]
    if kind == "ngram":
        return {"method": "ngram", "prompt_lookup_min": NGRAM_MIN, "prompt_lookup_max": int(arg) if arg else NGRAM_MAX}
    if kind == "self":
        if run_dir is None:
            return f"draft {spec}: needs the run directory"
        return {"method": "draft_model", "model": str(Path(run_dir) / "variants" / arg)}
    if kind == "hf":
        path = Path(arg).expanduser()
        return {"method": "draft_model", "model": str(path.resolve()) if path.exists() else arg}
    if kind == "eagle3":
        return {"method": "eagle3", "model": str(Path(arg).expanduser().resolve())}
    return f"draft kind '{kind}' has no vLLM method here (kinds: {', '.join(KINDS)})"


def speculative_config(spec: str, k: int, run_dir: Path | None,
                       by_batch: list[list[int]] | None = None) -> dict | str:
    """The complete speculative_config for draft `spec` at k (and a per-batch-size schedule of
    [start_bs, end_bs, k] rows, vLLM's num_speculative_tokens_per_batch_size), or why none."""
    base = draft_method(spec, run_dir)
    if isinstance(base, str):
        return base
    if k < 1:
        raise ValueError("k must be >= 1")
    out = {**base, "num_speculative_tokens": int(k)}
    if by_batch:
        out["num_speculative_tokens_per_batch_size"] = [list(map(int, r)) for r in by_batch]
    return out


def serve_command(model: str | Path, spec: dict | None) -> str:
    """The `vllm serve` line that deploys `model` with `spec` (None: without speculation)."""
    parts = ["vllm", "serve", str(model)]
    if spec:
        parts += ["--speculative-config", json.dumps(spec, sort_keys=True, separators=(",", ":"))]
    return " ".join(shlex.quote(p) for p in parts)
