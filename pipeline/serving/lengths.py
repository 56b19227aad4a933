"""Request lengths for the serving simulation: drawn from the workload the acceptance stage ran, as
vLLM's serving benchmark draws them from ShareGPT, instead of fixed ones.

    from pipeline.serving.lengths import request_lengths
    lengths = request_lengths(acceptance_json, slice_name="all", temperature="0.0")
    lengths["pairs"]   # [[prompt_tokens, output_tokens], ...] one per workload prompt, or None (fixed)

Each workload prompt gives one pair: its prompt tokens, and the reference reply's length where the
workload has one, else the tokens the target generated for it in the acceptance stage (capped by
acceptance.max_new_tokens; one token is raised to two). Without a workload block, `lengths:
"fixed"` (serving.prompt_tokens, serving.output_tokens). Method: docs/methods/batching.md.
"""
from __future__ import annotations

import numpy as np


def _generated(acceptance: dict, slice_name: str, temperature: str) -> dict[str, int]:
    """prompt id -> tokens the target generated (the prefill's first included) at `temperature`,
    from the slice's per-prompt records, else from every slice's (a slice can be one category)."""
    slices = acceptance.get("slices") or {}
    names = [slice_name] + [s for s in slices if s != slice_name]
    out: dict[str, int] = {}
    for name in names:
        for rec in ((slices.get(name) or {}).get(temperature) or {}).get("per_prompt") or []:
            if "prompt" in rec and "tokens" in rec:
                out.setdefault(str(rec["prompt"]), int(rec["tokens"]) + 1)
    return out


def request_lengths(acceptance: dict, slice_name: str, temperature: str) -> dict:
    """{"lengths": "workload" | "fixed", "pairs", "source", "workload", "n_pairs", mean lengths,
    counts of prompts without a length and of outputs raised to two} (module docstring)."""
    block = acceptance.get("workload")
    if not isinstance(block, dict) or not block.get("prompts"):
        return {"lengths": "fixed", "pairs": None, "workload": None,
                "source": "fixed lengths (serving.prompt_tokens, serving.output_tokens): the acceptance JSON "
                          "has no workload block (made before workloads)"}
    generated = _generated(acceptance, slice_name, temperature)
    pairs, reference, from_target, missing, raised = [], 0, 0, 0, 0
    for p in block["prompts"]:
        prompt = p.get("prompt_tokens")
        output = p.get("output_tokens")
        if output is not None:
            reference += 1
        elif str(p.get("id")) in generated:
            output = generated[str(p["id"])]
            from_target += 1
        if prompt is None or output is None:
            missing += 1
            continue
        if int(output) < 2:
            raised += 1
        pairs.append([max(1, int(prompt)), max(2, int(output))])
    name = block.get("name")
    if not pairs:
        return {"lengths": "fixed", "pairs": None, "workload": name,
                "source": f"fixed lengths (serving.prompt_tokens, serving.output_tokens): no prompt of workload "
                          f"{name!r} has both a prompt length and an output length"}
    cap = acceptance.get("max_new_tokens")
    parts = []
    if reference:
        parts.append(f"{reference} from the workload's reference replies")
    if from_target:
        parts.append(f"{from_target} from the tokens the target generated for the prompt in the acceptance stage "
                     f"at T = {temperature} (capped at acceptance.max_new_tokens = {cap}, so longer replies are cut)")
    x = np.asarray(pairs, dtype=float)
    return {"lengths": "workload", "pairs": pairs, "workload": name,
            "source": (f"(prompt, output) pairs of workload {name!r}, drawn with replacement under the run's seed; "
                       f"prompt lengths from the workload, output lengths: {'; '.join(parts)}"),
            "n_pairs": len(pairs), "mean_prompt_tokens": float(x[:, 0].mean()),
            "mean_output_tokens": float(x[:, 1].mean()), "without_lengths": missing, "outputs_raised_to_two": raised}
