"""Shared fixtures: a tiny random Llama with a tiny tokenizer (seconds), and the real embedded
model prepared once per session (about half a minute)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline.core.process import set_up_process

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
set_up_process()

REPO = Path(__file__).resolve().parent.parent
CORPUS = (
    "the quick brown fox jumps over the lazy dog. a cat sat on the mat and looked at the dog. "
    "def add(a, b): return a + b\nprint(add(1, 2))\n{\"name\": \"get_weather\", \"arguments\": "
    "{\"city\": \"Paris\"}}\nOne two three four five six seven eight nine ten. "
    "Le chat est sur la table. Der Hund ist im Garten. El perro come pan. 0123456789 + - * / = ?"
)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_tokenizer():
    """A byte-level BPE tokenizer trained in-process on CORPUS (vocab 320)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
        unk_token="<|endoftext|>", pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_llama(tokenizer, layers: int = 4, hidden: int = 64, seed: int = 0):
    """A random Llama whose linear layers have input widths divisible by 32 (GPTQ-friendly)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(cfg).eval()
    # Larger-than-default init so the random model's distributions are not nearly uniform.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model


# Architectures the tests build at random: one per family of module layout specq must handle.
#   llama      model.layers, nn.Linear            qwen2   model.layers, nn.Linear with q/k/v biases
#   gpt2       transformer.h, transformers Conv1D (weight stored [in, out])
#   qwen2_moe  model.layers, routed experts as fused 3-D parameters + a shared expert
#   gemma2     alternating sliding-window layers (a cache the engine cannot roll back)
ARCHITECTURES = ("llama", "qwen2", "gpt2", "qwen2_moe", "gemma2")


def make_tiny_model(arch: str, tokenizer, layers: int = 4, hidden: int = 64, seed: int = 0):
    """A random causal LM of family `arch` sized like make_tiny_llama (every input width a
    multiple of 32, so GPTQ group size 32 divides each layer)."""
    import torch
    import transformers

    if arch == "llama":
        return make_tiny_llama(tokenizer, layers=layers, hidden=hidden, seed=seed)
    special = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    attention = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(intermediate_size=2 * hidden, **attention, **special)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "gpt2":
        cfg = transformers.GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=1024, **special)
        cls = transformers.GPT2LMHeadModel
    elif arch == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(intermediate_size=2 * hidden, moe_intermediate_size=hidden,
                                          shared_expert_intermediate_size=hidden, num_experts=4,
                                          num_experts_per_tok=2, **attention, **special)
        cls = transformers.Qwen2MoeForCausalLM
    elif arch == "gemma2":
        cfg = transformers.Gemma2Config(intermediate_size=2 * hidden, head_dim=hidden // 4, sliding_window=16,
                                        **attention, **special)
        cls = transformers.Gemma2ForCausalLM
    else:
        raise ValueError(f"unknown test architecture {arch} (have {', '.join(ARCHITECTURES)})")
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # as make_tiny_llama: distributions far from uniform
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "wpe" not in name:
                p.mul_(4.0)
    return model


def save_as_prepared(model, tokenizer, path: Path) -> Path:
    """Save like the prepare stage does: HF dir + meta.json with scheme 'reference'."""
    from pipeline.models.loading import model_facts

    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    meta = {"stage": "prepare", "scheme": "reference", "source": {"kind": "test"}, "dtype": "float32",
            **model_facts(model)}
    (path / "meta.json").write_text(json.dumps(meta, indent=2))
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tiny_tokenizer):
    return make_tiny_llama(tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_model, tiny_tokenizer) -> Path:
    """A prepared-model directory (runs/<run>/model layout) holding the tiny random Llama."""
    return save_as_prepared(tiny_model, tiny_tokenizer, tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def embedded_model_dir(tmp_path_factory) -> Path:
    """runs/<run>/model for the real embedded SmolLM2-135M, made by the prepare stage once."""
    from pipeline.__main__ import main

    run = tmp_path_factory.mktemp("embedded") / "run"
    rc = main(["prepare", "--run", str(run), "--config", str(REPO / "configs/smoke.yaml"),
               "--model", "smollm2-135m"])
    assert rc == 0
    return run / "model"


def two_sample_p(a, b):
    """Chi-square p that two samples of tokens come from one distribution (categories with fewer
    than 10 draws in both samples together pooled into one column)."""
    import numpy as np
    from scipy import stats

    cats = sorted(set(a) | set(b))
    table = np.array([[a.count(c) for c in cats], [b.count(c) for c in cats]])
    rare = table.sum(0) < 10
    table = np.column_stack([table[:, ~rare], table[:, rare].sum(1)]) if rare.any() else table
    table = table[:, table.sum(0) > 0]
    return stats.chi2_contingency(table)[1]
