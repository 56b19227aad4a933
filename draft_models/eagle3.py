"""`eagle3:<dir>`: an EAGLE-3 draft head (speculators format, or vLLM's LlamaForCausalLMEagle3 layout).

The head drafts from the target's hidden states, which only the serving engine hands it: the pair
is measured in vLLM (`{"method": "eagle3", "model": <dir>}`), and specq's own engine, which has no
hidden-state drafts, skips it with one line. `check` validates the directory against the target
before any engine starts: a config.json that names an EAGLE-3 head, weights, and the target's
hidden size and vocabulary.
"""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.core.stage import StageError

SERVED_ONLY = "an EAGLE-3 head drafts from the target's hidden states: it runs in vLLM only"


def head_config(path: Path) -> dict:
    """The head's own config (speculators' transformer_layer_config when it has one)."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise StageError(f"draft eagle3:{path}: no readable config.json ({e})") from None
    if cfg.get("speculators_model_type") == "eagle3" or "transformer_layer_config" in cfg:
        return {**cfg.get("transformer_layer_config", {}), "draft_vocab_size": cfg.get("draft_vocab_size")}
    if not any("eagle3" in a.lower() for a in cfg.get("architectures") or []):
        raise StageError(f"draft eagle3:{path}: config.json names {cfg.get('architectures')}, not an EAGLE-3 head "
                         "(LlamaForCausalLMEagle3, or a speculators eagle3 config)")
    return cfg


def check(spec: str, target_config) -> dict:
    """What the drafts stage records for an eagle3 draft; a head that cannot fit the target is one line."""
    _, _, arg = spec.partition(":")
    if not arg:
        raise StageError(f"draft {spec}: expected eagle3:<directory of the head>")
    path = Path(arg).expanduser()
    if not path.is_dir():
        raise StageError(f"draft {spec}: {path} is not a directory")
    cfg = head_config(path)
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise StageError(f"draft {spec}: no weights (*.safetensors) in {path}")
    text = getattr(target_config, "get_text_config", lambda: target_config)()
    hidden = cfg.get("target_hidden_size") or cfg.get("hidden_size")
    if hidden is not None and hidden != text.hidden_size:
        raise StageError(f"draft {spec}: the head's hidden size {hidden} is not the target's {text.hidden_size}")
    if cfg.get("vocab_size") not in (None, text.vocab_size):
        raise StageError(f"draft {spec}: the head's vocabulary {cfg['vocab_size']} is not the target's {text.vocab_size}")
    return {"dir": str(path.resolve()), "architectures": cfg.get("architectures"),
            "draft_vocab_size": cfg.get("draft_vocab_size"), "runs_in": "vllm", "note": SERVED_ONLY}


def build(spec, target, tokenizer, run_dir, device):
    raise StageError(f"draft {spec}: {SERVED_ONLY} (specq's engine cannot build it)")
