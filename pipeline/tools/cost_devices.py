"""The devices the cost model (pipeline/tools/estimate.py) knows, and the constants it assumes or
measured for them: datasheet bandwidth and FLOP/s with the shares a step reaches, host time per
eager layer, compile time per graph, disk, stage start-up, GPTQ's cost, and how much slower a
quantized forward is than its bytes predict. Each constant says where it comes from.

    from pipeline.tools.cost_devices import DEVICES
    h100 = DEVICES["h100"]
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.quality.calibration import TOKEN_COST

BW_EFF = 0.70  # assumed share of the datasheet bandwidth a decode step reaches (make gpu-check measures it)
FLOPS_EFF = 0.50  # assumed share of the dense bf16 peak a prefill reaches
# Host time per decoder layer of an eager forward on a GPU (launches, Python), assumed: gpt-fast's eager
# baseline ran Llama-2-7B at 26.9 tokens/s on an A100 (PyTorch blog "Accelerating Generative AI with
# PyTorch II: GPT, Fast", 2023), ~37 ms a token over a ~7 ms bandwidth floor, ~0.9 ms a layer.
EAGER_LAYER_S = 0.6e-3
# torch.compile (inductor + CUDA graphs) per graph the latency plan compiles: a guess between a warm
# inductor cache's ~20 s and gpu_check's cautious 150 s for an 8B graph (not yet timed on a GPU here).
COMPILE_S_PER_GRAPH = 45.0
# A width that shares a dynamic-width graph (latency.compile_dynamic_width) compiles nothing; its CUDA
# graph is warmed up and recorded by CompileSession.warm (its record's record_s). Assumed, not timed on
# a GPU here.
CUDA_GRAPH_RECORD_S = 2.0
# A dynamic-width graph's compile against a static one's. Measured with inductor on this CPU (a 2-layer
# Llama, fresh processes, inductor's caches off, 2026-12-03): widths 2..9 as one dynamic graph 14.2 s, as
# eight static graphs 82.2 s (10.9-11.4 s each but the first, 4.6 s, which came right after the static
# width-2 catch-up graph of the same model). The base is the typical static graph (11 s). Greedy tokens
# equal. Not timed on a GPU.
DYNAMIC_COMPILE_FACTOR = 1.3
DISK_BPS = 2.0e9  # assumed NVMe read or write, bytes/s
START_S = 15.0  # assumed per stage process: imports, CUDA context
# GPTQ: "175 billion parameters in approximately four GPU hours" on one A100, 128 x 2048 calibration
# tokens (Frantar et al., GPTQ, ICLR 2023), scaled by parameters, by A100 / the device's bandwidth (the
# column loop is memory- and launch-bound) and by calibration tokens, half the time assumed to be the
# calibration forwards and Hessians (which scale with tokens), half the solve (which does not).
GPTQ_A100_S_PER_PARAM = 4 * 3600 / 175e9
GPTQ_REF_TOKENS = 128 * 2048
A100_BPS = 2.039e12
BUILTIN_CALIBRATION_TOKENS = 10_900  # evals/data/calibration.txt (docs/methods/quality-slices.md: about 10.9k tokens)
QUANTIZE_OTHER_S = 20.0  # assumed: bitsandbytes / torchao quantizing an 8B model at load
# A quantized variant's forward / what the formula gives for its bytes: stated guesses inside the
# 1.3-3x an earlier review gave quantized variants against bf16 (dequantizing kernels, more launches).
SLOWDOWN_GPU = {"none": 1.0, "checkpoint": 1.0, "gptq": 1.5, "torchao-int8wo": 1.5, "bnb-nf4": 2.0, "bnb-int8": 3.0}

# The 2-core CPU, measured with SmolLM2-135M (134,515,072 parameters): a forward 85 ms in float32, 42 in
# bf16 (pipeline/core/device.py), 2.3 ms per prefill row-token (pipeline/quality/calibration.py TOKEN_COST).
SMOLLM2_FP32_BYTES = 538_060_288
CPU_FP32_STEP_S = 0.085
# quantize took 170-200 s, GPTQ most of it (docs/results/2026-12-03-run-costs.md), at 16 x 256 calibration tokens
CPU_GPTQ_S = 150.0
# Fitted: with the dequantized copy's bytes (CPU kernels dequantize in software), a quantized variant
# then scores ~1.5x slower than the reference, the spread of the 1.4-2.3 items/s per variant measured on
# 2026-11-29 (docs/results/2026-12-03-run-costs.md).
SLOWDOWN_CPU = {"none": 1.0, "checkpoint": 1.0, "gptq": 1.25, "torchao-int8wo": 1.25, "bnb-nf4": 1.25,
                "bnb-int8": 1.25}


def gptq_scale(tokens: int) -> float:
    return 0.5 + 0.5 * tokens / GPTQ_REF_TOKENS


@dataclass(frozen=True)
class Device:
    name: str
    label: str
    bandwidth: float  # bytes/s
    flops: float  # dense matmul FLOP/s in the compute dtype
    source: str
    memory: float  # bytes the latency memory plan may fill, weights included
    bw_eff: float = BW_EFF
    flops_eff: float = FLOPS_EFF
    eager_layer_s: float = EAGER_LAYER_S
    compile_s: float = COMPILE_S_PER_GRAPH
    record_s: float = CUDA_GRAPH_RECORD_S
    disk: float = DISK_BPS
    start_s: float = START_S
    quantize_other_s: float = QUANTIZE_OTHER_S
    slowdown: dict = field(default_factory=lambda: dict(SLOWDOWN_GPU))
    dequantizes: bool = False  # quantized matmuls dequantize to the compute dtype in software
    cuda: bool = True
    cpus: int = 16
    gptq_cpu_s: float = CPU_GPTQ_S  # a CPU's GPTQ of SmolLM2-135M on 16 x 256 calibration tokens

    @property
    def gptq_s_per_param(self) -> float:
        """GPTQ seconds per parameter at GPTQ_REF_TOKENS calibration tokens."""
        if not self.cuda:
            return self.gptq_cpu_s / (SMOLLM2_FP32_BYTES / 4 * gptq_scale(16 * 256))
        return GPTQ_A100_S_PER_PARAM * A100_BPS / self.bandwidth


DEVICES = {
    "h100": Device("h100", "H100 SXM 80 GB", 3.35e12, 989e12,
                   "NVIDIA H100 datasheet (SXM5): 3.35 TB/s HBM3, 989 TFLOPS dense bf16", 80e9),
    "h200": Device("h200", "H200 SXM 141 GB", 4.8e12, 989e12,
                   "NVIDIA H200 datasheet: 4.8 TB/s HBM3e, 989 TFLOPS dense bf16", 141e9),
    "a100-80gb": Device("a100-80gb", "A100 SXM 80 GB", A100_BPS, 312e12,
                        "NVIDIA A100 datasheet (80 GB SXM): 2,039 GB/s HBM2e, 312 TFLOPS dense bf16", 80e9),
    # Effective figures, so the efficiencies are 1: bandwidth = float32 weights / a step (which predicts
    # the bf16 step at 42.5 ms: measured 42), FLOP/s = 2 x parameters / 2.3 ms; launches are in the step.
    "cpu-2core": Device("cpu-2core", "this project's 2-core CPU", SMOLLM2_FP32_BYTES / CPU_FP32_STEP_S,
                        2 * SMOLLM2_FP32_BYTES / 4 / TOKEN_COST,
                        "measured: SmolLM2-135M step 85 ms in float32, 2.3 ms per prefill token", 16e9,
                        bw_eff=1.0, flops_eff=1.0, eager_layer_s=0.0, compile_s=0.0, record_s=0.0, disk=0.5e9, start_s=10.0,
                        quantize_other_s=5.0, slowdown=dict(SLOWDOWN_CPU), dequantizes=True, cuda=False, cpus=2),
}
