"""GPU check for issue #24 (2a): the batched cells and closed loop compiled with inductor + CUDA
graphs, as `make latency CONFIG=configs/gpu.yaml` runs them. Not a pytest test (needs CUDA).

    PYTHONPATH=. .venv/bin/python tests/gpu_batched_compile.py [MODEL_DIR]
    PYTHONPATH=. .venv/bin/python tests/gpu_batched_compile.py --cpu    # the same on CPU, dynamo's eager backend

Without MODEL_DIR a random 4-layer Llama of SmolLM2's width (bf16) is built on the GPU. Prints the
compile record (planned = compiled graphs, no eager shape, no recompile, CUDA-graph skips) and
each cell's run mode, and exits 1 if any cell or closed-loop mode did not run compiled or any
speedup is flagged (like_with_like false).
"""
from __future__ import annotations

import json
import sys

import torch


def main() -> int:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from draft_models.layerskip import truncate
    from pipeline.core.config import Config
    from pipeline.decode.drafts import ModelDraft
    from pipeline.latency.batched import batched_pair
    from pipeline.latency.plan import compile_session, draft_label

    cpu = "--cpu" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--cpu"]
    device = torch.device("cpu" if cpu else "cuda")
    if args:
        tok = AutoTokenizer.from_pretrained(args[0])
        model = LlamaForCausalLM.from_pretrained(args[0], dtype=torch.bfloat16).to(device).eval()
    else:
        from tests.conftest import make_tiny_tokenizer

        tok = make_tiny_tokenizer()
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                          num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=4096)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(device, torch.float32 if cpu else torch.bfloat16).eval()
    lat = Config.model_validate({"latency": {"spec_batch_sizes": [1, 4], "closed_loop_batch_sizes": [1, 4],
                                             "closed_loop_waves": 2, "closed_loop_tokens": 16, "new_tokens": 16,
                                             "warmup": 1, "repeats": 2, "compile": True,
                                             "compile_backend": "eager" if cpu else "auto"}}).latency
    ks = [1, 2, 3]
    if cpu:  # a check of the machinery only: short prompts, fewer graphs
        from pipeline.latency import batched as batch_latency

        batch_latency.KINDS = ("chat", "code", "structured")
        lat = lat.model_copy(update={"new_tokens": 6, "closed_loop_tokens": 6, "repeats": 1, "warmup": 0})
        ks = [1]
    draft = ModelDraft("layerskip:2", truncate(model, 2), model.config.vocab_size)
    session, record = compile_session(lat, device)
    session.attach(model, "target")
    session.attach(draft.model, draft_label("layerskip:2"))
    try:
        doc = batched_pair("gpu", "layerskip:2", model, draft, tok, ks, lat, device, 0.95, 0, session=session)
    finally:
        session.close()
    rec = doc["compile"]
    print(json.dumps({k: rec[k] for k in ("ran", "planned_graphs", "graphs_compiled", "recompiles", "eager_shapes",
                                          "cudagraph_skipped_shapes", "compile_s")}, indent=1))
    bad = []
    for c in doc["cells"]:
        line = (f"B={c['batch']} k={c['k']}: {c['run_mode']['label']} ms/token {c['ms_per_token']['median']:.3f}"
                + (f" speedup {c['speedup']['median']:.2f} like_with_like={c['like_with_like']}" if c["k"] else ""))
        print(line)
        if c["run_mode"]["steps"] != "compiled" or c.get("like_with_like") is False:
            bad.append(line)
    for loop in doc["closed_loop"]:
        print(f"closed loop B={loop['batch']} k={loop['k']}: plain {loop['plain']['run_mode']['label']}, "
              f"speculative {loop['speculative']['run_mode']['label']}, like_with_like={loop['like_with_like']}")
        if loop["like_with_like"] is not True:
            bad.append(f"closed loop B={loop['batch']}")
    print("FAILED: " + "; ".join(bad) if bad else "OK: every batched cell and closed-loop mode ran compiled")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
