"""The drafts stage: check every configured draft against the reference and describe it.

    python -m pipeline drafts --run runs/smollm2-135m --config configs/default.yaml [--drafts "ngram layerskip:8"]

Builds each spec in `drafts` against the reference variant (a bad spec, a missing variant or a
tokenizer unlike the target's stops the stage with one line) and writes
runs/<run>/drafts/<draft_slug>/meta.json; no weights are written (an eagle3:<dir> head is only
checked against the reference's config: it runs in vLLM).
"""
from __future__ import annotations

import torch

from draft_models import eagle3
from draft_models.registry import build_draft, draft_slug, parse_spec
from pipeline.core.device import resolve_device
from pipeline.core.stage import StageContext, StageError, progress, read_json
from pipeline.models.architecture import check_engine_cache
from pipeline.variants.schemes import load_variant


def reference_dir(ctx: StageContext):
    ref = ctx.config.quantize.reference
    path = ctx.run_dir / "variants" / ref
    if not (path / "meta.json").is_file():
        raise StageError(f"drafts: reference variant '{ref}' is missing at {path} (make quantize first)")
    return path


def describe(spec: str, draft, target, run_dir) -> dict:
    kind, arg = parse_spec(spec)
    meta: dict = {"spec": spec, "kind": kind, "slug": draft_slug(spec)}
    if kind == "ngram":
        meta.update(max_n=draft.max_n, q="one-hot", fallback="no match: propose nothing (a plain step)")
    else:
        params = sum(p.numel() for p in draft.model.parameters())
        meta.update(parameters=params, dtype=str(next(draft.model.parameters()).dtype).replace("torch.", ""))
    if kind == "layerskip":
        cfg = draft.model.config
        meta.update(layers=int(arg), target_layers=target.config.num_hidden_layers,
                    shares_weights_with="target", note=f"first {cfg.num_hidden_layers} layers + final norm + LM head")
    if kind == "self":
        vmeta = read_json(run_dir / "variants" / arg / "meta.json", "variant meta.json")
        meta.update(variant=arg, variant_dir=f"variants/{arg}", scheme=vmeta.get("scheme"),
                    variant_input_hash=vmeta.get("input_hash"))
    if kind == "hf":
        meta.update(source=arg, tokenizer_check="same vocab, ids and special tokens as the target")
    return meta


def run(ctx: StageContext) -> None:
    from transformers import AutoConfig

    specs = list(dict.fromkeys(ctx.config.drafts))
    slugs = [draft_slug(s) for s in specs]  # validates every spec before any work
    if len(set(slugs)) != len(slugs):
        raise StageError(f"drafts: two specs map to the same name ({', '.join(slugs)})")
    device = resolve_device(ctx.config.device)
    ref = reference_dir(ctx)
    # The first stage that needs the decode engine refuses an architecture it cannot run, before
    # any draft is built (acceptance and latency read this stage's output).
    check_engine_cache(AutoConfig.from_pretrained(ref))
    ref_meta = read_json(ref / "meta.json", "variant meta.json")
    target = tokenizer = None
    made = {}
    for spec, slug in zip(specs, slugs):
        item = ctx.item(slug, {"spec": spec, "reference": ref_meta.get("input_hash"), "device": str(device)})
        made[slug] = {"spec": spec, "dir": f"drafts/{slug}"}
        if item.fresh:
            continue
        progress(f"drafts: {spec}")
        if parse_spec(spec)[0] == "eagle3":  # served only: checked against the target's config, not built
            item.meta = {"spec": spec, "kind": "eagle3", "slug": slug, **eagle3.check(spec, AutoConfig.from_pretrained(ref))}
        else:
            if target is None:
                target, tokenizer = load_variant(ref, device=device)
            with torch.inference_mode():
                draft = build_draft(spec, target, tokenizer, ctx.run_dir, device)
            item.meta = describe(spec, draft, target, ctx.run_dir)
        with item.writing():
            pass
    ctx.meta["drafts"] = made
