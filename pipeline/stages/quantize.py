"""quantize: turn runs/<run>/model/ into the variants named in `quantize.variants`.

    python -m pipeline quantize --run runs/smollm2-135m --config configs/default.yaml
    make quantize MODEL=smollm2-135m

Each variant is one resumable item, `variants/<name>/` (an HF-style directory plus meta.json).
Every check that can fail fast (pipeline/variants/checks.py) runs before the first variant is made;
the quantizers and loaders come from the scheme registry (pipeline/variants/schemes.py). What
meta.json records: docs/methods/stages.md, "Variants: what quantize checks and records".
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from pipeline.core.device import DTYPES, auto_dtype, resolve_device, resolve_dtype
from pipeline.core.stage import StageContext, StageError, atomic_write_json, library_version, progress, read_json
from pipeline.models.architecture import architecture, float_matrix_fraction
from pipeline.models.bytes import bytes_in_memory
from pipeline.models.loading import load_tokenizer, weight_bytes
from pipeline.variants.checks import check_variant, reference_matrices
from pipeline.variants.quantizers import Job, load_calibration
from pipeline.variants.sanity import SANITY_MODULES, perplexity, sample_text, sanity_ids, timed_forward
from pipeline.variants.schemes import SCHEMES, load_variant


def _remove_stale(out_dir: Path, keep: set[str]) -> None:
    """Variant directories no longer in the config go, with unfinished `.tmp`/`.old` leftovers."""
    if not out_dir.is_dir():
        return
    for p in sorted(out_dir.iterdir()):
        if not p.is_dir():
            continue
        if p.name.endswith((".tmp", ".old")) or p.name not in keep:
            progress(f"quantize: removing {p} (not a variant in the config)")
            shutil.rmtree(p)


def _checkpoint_fingerprint(path: str | None) -> list | None:
    if not path or not Path(path).expanduser().is_dir():
        return None
    root = Path(path).expanduser()
    return sorted((str(p.relative_to(root)), p.stat().st_size, int(p.stat().st_mtime))
                  for p in root.rglob("*") if p.is_file())


def _compute_dtype(spec, scheme, device: torch.device) -> tuple[torch.dtype, str]:
    """A variant's compute dtype and why: the config's, or for `auto` core.device.auto_dtype (a
    checkpoint counts as quantized when its config.json carries a quantization_config)."""
    if spec.dtype != "auto":
        return resolve_dtype(spec.dtype, device), "set in the config"
    quantized = bool(scheme.quantizes)
    if spec.scheme == "checkpoint" and spec.path:
        try:
            quantized = "quantization_config" in json.loads((Path(spec.path) / "config.json").read_text())
        except (OSError, ValueError):
            quantized = True  # the checkpoint stage reports the unreadable file itself
    return auto_dtype(device, quantized)


def run(ctx: StageContext) -> None:
    qcfg = ctx.config.quantize
    device = resolve_device(ctx.config.device)
    src = ctx.run_dir / "model"
    src_meta = read_json(src / "meta.json", "prepared model meta.json")
    storage_dtype = DTYPES.get(src_meta.get("dtype", "bfloat16"), torch.bfloat16)

    # Everything that can fail fast fails before the first (possibly long) quantization.
    tokenizer = load_tokenizer(src)
    for name, spec in qcfg.variants.items():
        check_variant(name, spec, src, tokenizer, device)
    _remove_stale(ctx.out_dir, set(qcfg.variants))
    reference_matrix_params = sum(w.param.numel() for w in reference_matrices(src))
    calibration = None
    if any(SCHEMES[v.scheme].calibrated for v in qcfg.variants.values()):
        calibration = load_calibration(qcfg.calibration, tokenizer)
        progress(f"quantize: calibration {calibration.path.name}: {len(calibration.windows)} windows, "
                 f"{calibration.tokens} of {calibration.tokens_available} tokens, sha256 {calibration.sha256[:12]}")
    ids = sanity_ids(tokenizer, qcfg.sanity_tokens)
    sanity_sha = hashlib.sha256(json.dumps(ids).encode()).hexdigest()
    reference_ppl: dict[str, float] = {}  # dtype name -> reference perplexity

    def ref_perplexity(dtype: torch.dtype) -> float:
        key = str(dtype)
        if key not in reference_ppl:
            model, _ = load_variant(src, device, str(dtype).removeprefix("torch."))
            reference_ppl[key] = perplexity(model, ids)
            del model
        return reference_ppl[key]

    order = sorted(qcfg.variants, key=lambda n: n != qcfg.reference)  # the reference first
    summary = {}
    for name in order:
        spec = qcfg.variants[name]
        scheme = SCHEMES[spec.scheme]
        compute_dtype, dtype_reason = _compute_dtype(spec, scheme, device)
        inputs = {
            "name": name, "variant": spec.model_dump(mode="json"), "model": ctx.upstream["prepare"].get("input_hash"),
            "device": device.type, "seed": ctx.config.seed, "sanity": sanity_sha,
            "calibration": ({**qcfg.calibration.model_dump(mode="json"), "sha256": calibration.sha256}
                            if scheme.calibrated else None),
            "checkpoint": _checkpoint_fingerprint(spec.path) if spec.scheme == "checkpoint" else None,
            "libraries": {scheme.library: library_version(scheme.library)},
            "dtype_compute": str(compute_dtype),
        }
        item = ctx.item(name, inputs)
        if item.fresh:
            progress(f"quantize {name}: up to date")
        else:
            progress(f"quantize {name}: scheme {spec.scheme} -> {item.path}")
            job = Job(name=name, device=device, storage_dtype=storage_dtype, compute_dtype=compute_dtype,
                      seed=ctx.config.seed, log_dir=ctx.run_dir / "logs",
                      calibration=(lambda: calibration.windows) if calibration else None)
            with item.writing() as tmp:
                start = time.perf_counter()
                extra = scheme.quantize(src, tmp, spec, job)
                seconds = time.perf_counter() - start
                tokenizer.save_pretrained(tmp)  # the reference's tokenizer, byte for byte the same
                meta = {
                    "variant": name, "scheme": spec.scheme, "bits": spec.bits, "group_size": spec.group_size,
                    **extra,
                    "dtype_compute": str(compute_dtype).removeprefix("torch."), "dtype_reason": dtype_reason,
                    "dtype_storage": src_meta.get("dtype"),
                    "device": device.type, "device_fallback": extra.get("device_fallback"),
                    "release": spec.release, "weight_noise": spec.weight_noise,
                    "quantize_seconds": round(seconds, 3),
                    "calibration_sha256": calibration.sha256 if scheme.calibrated else None,
                    "calibration_tokens": calibration.tokens if scheme.calibrated else None,
                    "calibration_samples": len(calibration.windows) if scheme.calibrated else None,
                    "calibration_requested": ({"samples": qcfg.calibration.n_samples,
                                               "tokens": qcfg.calibration.n_samples * qcfg.calibration.max_tokens}
                                              if scheme.calibrated else None),
                    "calibration_source": str(calibration.path) if scheme.calibrated else None,
                    "reference_input_hash": ctx.upstream["prepare"].get("input_hash"),
                }
                atomic_write_json(tmp / "meta.json", meta)  # load_variant reads the scheme from it
                model, tok = load_variant(tmp, device)
                meta["architecture"] = architecture(model)
                # What the library actually did to the decoder's weight matrices (1.0 = nothing).
                meta["decoder_float_fraction"] = round(float_matrix_fraction(model, reference_matrix_params), 4)
                if scheme.quantizes and meta["decoder_float_fraction"] >= 1.0:
                    raise StageError(f"variant '{name}': scheme {spec.scheme} left every decoder weight matrix of "
                                     f"{meta['architecture']} unquantized")
                meta["bytes_in_memory"] = bytes_in_memory(model)
                meta["bytes_on_disk"] = weight_bytes(tmp)
                meta["perplexity"] = round(perplexity(model, ids), 4)
                meta["forward_seconds"] = timed_forward(model, ids)
                meta["sample"] = sample_text(model, tok)
                del model
                if spec.scheme == "none" and spec.weight_noise == 0:  # the same weights: no second pass
                    reference_ppl.setdefault(str(compute_dtype), meta["perplexity"])
                meta["reference_perplexity"] = round(ref_perplexity(compute_dtype), 4)
                meta["reference_bytes_on_disk"] = weight_bytes(src)
                meta["sanity"] = {"source": f"docstrings of Python {'.'.join(map(str, sys.version_info[:3]))} "
                                            f"modules {', '.join(SANITY_MODULES)}",
                                  "tokens": len(ids), "ids_sha256": sanity_sha}
                item.meta = meta
            progress(f"quantize {name}: {meta['quantize_seconds']:.1f} s, {meta['bytes_on_disk'] / 2**20:.1f} MiB on disk, "
                     f"{meta['bytes_in_memory'] / 2**20:.1f} MiB in memory, perplexity {meta['perplexity']:.2f} "
                     f"(reference {meta['reference_perplexity']:.2f}); sample: {meta['sample']!r}")
            if scheme.quantizes and meta["decoder_float_fraction"] > 0:
                progress(f"quantize {name}: {meta['decoder_float_fraction']:.0%} of the decoder weight parameters "
                         f"were left in floating point by {scheme.library} (layers it does not quantize)")
        m = item.meta
        summary[name] = {"scheme": spec.scheme, "dir": f"{ctx.out_dir.name}/{name}", "release": spec.release,
                         "bytes_on_disk": m.get("bytes_on_disk"), "bytes_in_memory": m.get("bytes_in_memory"),
                         "quantize_seconds": m.get("quantize_seconds"), "perplexity": m.get("perplexity"),
                         "reference_perplexity": m.get("reference_perplexity")}
    ctx.meta["reference"] = qcfg.reference
    ctx.meta["variants"] = summary
