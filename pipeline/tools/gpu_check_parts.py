"""The parts of `python -m pipeline.tools.gpu_check`: the random model, the timed cells, the greedy
checks, and the one Markdown table. See pipeline/tools/gpu_check.py for what the check is and how to run it.

Timing is the engine's own (pipeline.decode.engine.generate with pipeline.decode.timing: CUDA events
on GPU, a synchronized clock on CPU), every step eager: one warm-up run per cell, then `repeats`
timed runs; figures are medians with min and max.
"""
from __future__ import annotations

import statistics
import time

import torch

from pipeline.decode.attention import attention_path
from pipeline.decode.cache import CachedModel
from pipeline.decode.drafts import ModelDraft
from pipeline.decode.engine import generate
from pipeline.latency.memory import cache_len
from pipeline.latency.roofline import bytes_per_step, model_bytes, roofline, step_kv_passes

# Model shapes (transformers LlamaConfig fields) and each shape's default run settings.
SHAPES = {
    # Llama-3-8B / 3.1-8B (from its published config.json; rope settings do not change latency).
    "8b": {"config": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                          tie_word_embeddings=False),
           "run": dict(batches=[1, 8], context=512, new_tokens=64, ks=[1, 2, 3, 4, 5, 6],
                       draft_layers=8, repeats=3)},
    # The same parts at CPU-test size (tests/test_gpu_check.py).
    "tiny": {"config": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                            tie_word_embeddings=False),
             "run": dict(batches=[1, 2], context=24, new_tokens=12, ks=[1, 2, 3],
                         draft_layers=1, repeats=2)},
}

# bf16 keeps 8 significant bits; after a deep forward two logits within ~2% of the top logit's
# magnitude can swap order between two forward shapes (a 1-token step vs a k+1-token verify).
NEAR_TIE_RELATIVE = 0.02


# ---------------------------------------------------------------- the model and the draft


def build_model(shape: str, device: torch.device, dtype: torch.dtype, seed: int):
    """A random Llama of `shape` built directly on `device` in `dtype` (no host copy of 8B weights).
    Weights: N(0, 1/fan_in) linears (activations keep their scale through the layers), N(0, 1)
    embeddings, unit norms, and an LM head 4x that scale, so the next-token distributions are
    peaked like a trained model's rather than flat (flat logits make every greedy step a tie)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**SHAPES[shape]["config"])
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2:
                p.fill_(1.0)
            elif name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 1.0, generator=gen)
            else:
                scale = 4.0 if name.endswith("lm_head.weight") else 1.0
                p.normal_(0.0, scale / p.shape[1] ** 0.5, generator=gen)
    return model.eval()


def make_draft(model, layers: int) -> ModelDraft:
    """layerskip:<layers>: the target's first layers, final norm and head (shared tensors)."""
    from draft_models.layerskip import truncate

    small = truncate(model, layers)
    return ModelDraft(f"layerskip:{layers}", small, vocab_size=model.config.vocab_size)


def prompt(vocab: int, batch: int, context: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, context), generator=torch.Generator().manual_seed(seed))  # [B, T]


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


# ---------------------------------------------------------------- greedy equality


@torch.inference_mode()
def compare_greedy(model, ids: torch.Tensor, reference: list[int], tokens: list[int]) -> dict:
    """Equal, or where the outputs first differ and the target's logit gap between the two tokens
    there (one uncached forward over the prompt and the reference up to that point)."""
    if tokens == reference:
        return {"equal": True}
    n = min(len(tokens), len(reference))
    i = next((j for j in range(n) if tokens[j] != reference[j]), n)
    out = {"equal": False, "first_divergence": i}
    if i == n:
        return {**out, "note": f"lengths differ ({len(tokens)} vs {len(reference)})"}
    device = next(model.parameters()).device
    seq = torch.cat([ids[0].to(device), torch.tensor(reference[:i], dtype=torch.long, device=device)])
    logits = model(input_ids=seq.unsqueeze(0), logits_to_keep=1).logits[0, -1].float()
    gap = float(logits[reference[i]] - logits[tokens[i]])
    top = float(logits.max())
    return {**out, "reference_token": reference[i], "token": tokens[i], "logit_gap": gap, "top_logit": top,
            "near_tie": abs(gap) <= NEAR_TIE_RELATIVE * max(1.0, abs(top))}


# ---------------------------------------------------------------- timed parts


def _step_s(check, device: torch.device) -> float:
    """A pessimistic per-step time for the budget: the slowest step measured so far, else a guess."""
    return check.slowest_step_s or (0.08 if device.type == "cuda" else 0.02)


def _note_step(check, seconds: float) -> None:
    check.slowest_step_s = max(check.slowest_step_s, seconds)


def plain_part(check, model, cells, args, gbps) -> dict:
    """TTFT and TPOT of plain decode per planned cell, bytes per step and % of the roofline."""
    device = next(model.parameters()).device
    mb = model_bytes(model)
    part = check.doc["parts"].setdefault("plain", {"cells": []})
    for cell in cells:
        steps = (1 + args.repeats) * args.new_tokens * max(1.0, cell.batch / 8)
        if not check.fits(f"plain B={cell.batch}", steps * _step_s(check, device)):
            continue
        ids = prompt(model.config.vocab_size, cell.batch, cell.context, args.seed)
        run = dict(cache_len=cell.cache_len, prefill_chunk=cell.prefill_chunk)
        t0 = time.perf_counter()
        generate(model, ids, args.new_tokens, **run)
        warm_s = time.perf_counter() - t0
        ttft, tpot = [], []
        for _ in range(args.repeats):
            res = generate(model, ids, args.new_tokens, **run)
            ttft.append(res.prefill_s * 1e3)
            tpot.append(res.decode_s / (len(res.batch_tokens[0]) - 1) * 1e3)
        CachedModel.release(model)
        _note_step(check, max(tpot) / 1e3)
        passes = step_kv_passes(model, width=1)
        step = bytes_per_step(mb["weight_bytes"], cell.batch, cell.context + args.new_tokens / 2,
                              mb["kv_bytes_per_token"], kv_passes=passes)
        row = {"batch": cell.batch, "context": cell.context, "cache_len": cell.cache_len,
               "prefill_chunk": cell.prefill_chunk, "ttft_ms": summary(ttft), "tpot_ms": summary(tpot),
               "tokens_per_s": cell.batch * 1e3 / statistics.median(tpot), "bytes_per_step": step,
               "attention_path": attention_path(model), "kv_passes": passes, "warmup_s": round(warm_s, 3),
               "tokens": res.batch_tokens[0]}
        if gbps:
            row.update(roofline(step, statistics.median(tpot) / 1e3, gbps))
        part["cells"].append(row)
        check.progress(f"plain B={cell.batch}: TPOT {statistics.median(tpot):.2f} ms"
                       + (f", {100 * row['roofline_fraction']:.3g}% of the bandwidth roofline" if gbps else ""))
        check.save()
    return part


def speculative_part(check, model, draft, args, reference) -> dict:
    """Round time (draft + verify + overhead), tokens per round and ms/token at each k, B = 1 on
    the plain B = 1 cell's prompt, and whether the greedy output equals plain greedy."""
    device = next(model.parameters()).device
    ids = prompt(model.config.vocab_size, 1, args.context, args.seed)
    length = cache_len(args.context, args.new_tokens)
    part = check.doc["parts"].setdefault("speculative", {"draft": draft.spec, "cache_len": length, "rows": []})
    for k in args.ks:
        steps = (1 + args.repeats) * args.new_tokens * (1 + k * args.draft_layers / model.config.num_hidden_layers)
        if not check.fits(f"speculative k={k}", steps * _step_s(check, device)):
            continue
        if reference is None:  # the plain B = 1 cell did not run: plain greedy output made here
            reference = generate(model, ids, args.new_tokens, cache_len=length).tokens
        t0 = time.perf_counter()
        generate(model, ids, min(args.new_tokens, 2 * k + 4), draft=draft, k=k, cache_len=length)
        warm_s = time.perf_counter() - t0
        fig: dict[str, list[float]] = {n: [] for n in ("round_ms", "draft_ms", "verify_ms", "ms_per_token",
                                                       "tokens_per_round")}
        for _ in range(args.repeats):
            res = generate(model, ids, args.new_tokens, draft=draft, k=k, cache_len=length)
            full = [r for r in res.rounds if r.k == k] or res.rounds  # the last rounds may be cut short
            n = len(full)
            fig["round_ms"].append(sum(r.round_s for r in full) / n * 1e3)
            fig["draft_ms"].append(sum(r.draft_s for r in full) / n * 1e3)
            fig["verify_ms"].append(sum(r.verify_s for r in full) / n * 1e3)
            fig["tokens_per_round"].append(sum(r.emitted for r in full) / n)
            fig["ms_per_token"].append(res.decode_s / (len(res.tokens) - 1) * 1e3)
        _note_step(check, max(fig["round_ms"]) / 1e3)
        row = {"k": k, **{name: summary(v) for name, v in fig.items()}, "warmup_s": round(warm_s, 3),
               "greedy": compare_greedy(model, ids, reference, res.tokens)}
        part["rows"].append(row)
        check.progress(f"speculative k={k}: round {row['round_ms']['median']:.2f} ms, "
                       f"{row['tokens_per_round']['median']:.2f} tokens/round, greedy "
                       + ("== plain" if row["greedy"]["equal"] else f"differs at {row['greedy']['first_divergence']}"))
        check.save()
    CachedModel.release(model)
    CachedModel.release(draft.model)
    return part


def fp32_part(check, model, draft, args) -> None:
    """Greedy speculative == plain greedy again with the model in float32, where it must be exact."""
    device = next(model.parameters()).device
    new = min(args.new_tokens, 32)
    ks = sorted({args.ks[0], args.ks[-1]})
    if not check.fits("greedy float32", 20 + (1 + len(ks)) * new * _step_s(check, device) * 2):
        return
    CachedModel.release(model)
    CachedModel.release(draft.model)
    model.float()  # the draft shares the target's modules, so it converts too
    ids = prompt(model.config.vocab_size, 1, args.context, args.seed)
    length = cache_len(args.context, new)
    reference = generate(model, ids, new, cache_len=length).tokens
    rows = [{"k": k, **compare_greedy(model, ids, reference, generate(model, ids, new, draft=draft, k=k,
                                                                      cache_len=length).tokens)} for k in ks]
    CachedModel.release(model)
    CachedModel.release(draft.model)
    check.doc["parts"]["greedy_float32"] = {"new_tokens": new, "rows": rows, "all_equal": all(r["equal"] for r in rows)}
    check.progress(f"float32 greedy: speculative == plain for k in {ks}: {all(r['equal'] for r in rows)}")
    check.save()


# ---------------------------------------------------------------- the table


def _ms(d: dict | None) -> str:
    return "-" if not d else f"{d['median']:.2f}"


def _greedy(g: dict | None) -> str:
    if not g:
        return ""
    if g["equal"]:
        return "greedy == plain"
    if "logit_gap" not in g:
        return f"greedy differs ({g.get('note', '')})"
    return (f"greedy differs at token {g['first_divergence']} (logit gap {g['logit_gap']:.3g}, top "
            f"{g['top_logit']:.3g}: {'near-tie' if g['near_tie'] else 'NOT a near-tie'})")


def render_markdown(doc: dict) -> str:
    env, parts = doc.get("environment", {}), doc.get("parts", {})
    settings = doc.get("settings", {})
    lines = [f"# gpu-check: {settings.get('shape', '?')} shape on {env.get('device_name', '?')}", "",
             f"python {env.get('python')} ({env.get('python_executable')}), torch {env.get('torch')} (CUDA "
             f"{env.get('torch_cuda')}), transformers {env.get('transformers')}, {settings.get('dtype')}, "
             f"context {settings.get('context')}, {settings.get('new_tokens')} new tokens, "
             f"{settings.get('repeats')} repeats; {doc.get('elapsed_s', 0):.0f} s of a {doc.get('budget_s', 0):.0f} s "
             f"budget{'' if doc.get('finished') else ' (not finished)'}. Times are medians (ms).", "",
             "| part | cell | measured | note |", "|---|---|---|---|"]
    bw = parts.get("bandwidth")
    if bw:
        lines.append(f"| bandwidth | copy {bw['bytes_per_copy'] / 2 ** 21:.0f} MiB | {bw['gbps']:.1f} GB/s | "
                     "tensor copy, read + write |")
    for c in parts.get("plain", {}).get("cells", []):
        roof = f", {100 * c['roofline_fraction']:.3g}% of roofline" if c.get("roofline_fraction") else ""
        lines.append(f"| plain decode | B={c['batch']}, context {c['context']} | TPOT {_ms(c['tpot_ms'])}{roof} | "
                     f"TTFT {_ms(c['ttft_ms'])} |")
    spec = parts.get("speculative", {})
    base = next((c for c in parts.get("plain", {}).get("cells", []) if c["batch"] == 1), None)
    for r in spec.get("rows", []):
        verify_cost = (f"; verify / plain step {r['verify_ms']['median'] / base['tpot_ms']['median']:.2f}"
                       if base else "")
        lines.append(f"| speculative ({spec.get('draft')}) | k={r['k']} | round {_ms(r['round_ms'])} (draft "
                     f"{_ms(r['draft_ms'])}, verify {_ms(r['verify_ms'])}), {r['tokens_per_round']['median']:.2f} "
                     f"tokens/round, {_ms(r['ms_per_token'])} ms/token | {_greedy(r['greedy'])}{verify_cost} |")
    g32 = parts.get("greedy_float32")
    if g32:
        lines.append(f"| greedy float32 | k={', '.join(str(r['k']) for r in g32['rows'])} | "
                     f"{'all equal' if g32['all_equal'] else 'DIFFER'} | "
                     f"{'; '.join(_greedy(r) for r in g32['rows'] if not r['equal'])} |")
    lines.append("")
    plan = doc.get("memory_plan")
    if plan:
        cells = [st for st in plan["steps"] if st["action"] == "run"]
        lines.append(f"- memory plan: {len(cells)} cells against {plan['budget_bytes'] / 1e9:.1f} GB free after the "
                     f"weights ({len(plan['dropped'])} dropped); prefill chunks: "
                     f"{', '.join(str(c['prefill_chunk']) for c in cells if c['prefill_chunk']) or 'none'}")
    for e in doc.get("errors", []):
        lines.append(f"- FAILED {e['part']}: {e['error']}")
    for s in doc.get("skipped", []):
        lines.append(f"- skipped {s['part']}: {s['why']}")
    for n in doc.get("notes", []):
        lines.append(f"- {n}")
    return "\n".join(lines) + "\n"
