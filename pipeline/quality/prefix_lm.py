"""An lm-eval model that computes each shared prompt prefix once and runs the rest in batches:
the quality stage's evaluator (`quality.evaluator: prefix`, the default).

lm-eval's HFLM runs every request from token 0. On the built-in slices many prompt tokens are a
prefix of another request's: the four options of a multiple-choice item share their question,
the questions about one haystack share the haystack, items of one tool share the schema and the
example. On a CPU, where prefill is compute-bound, those repeated tokens were most of the time.

How it works:
  * Requests are sorted by their token ids. Lexicographic order is the depth-first order of the
    requests' prefix tree, so requests that share a prefix are neighbours.
  * `plan_batches` cuts that order into batches of at most `batch_size` requests. A batch is a
    head (the prefix all its members share) and a tail per member. Whether the next request joins
    the current batch (a shorter head, more padded tail tokens) or starts a new one (one more
    forward call) is decided by a cost model of a forward pass: a fixed cost per call plus a cost
    per token (`CALL_COST`, `TOKEN_COST`: on the 2-core CPU one call of 1 token took 119 ms and
    each further token about 2.3 ms; the ratio is what matters).
  * `PrefixWalk` keeps one batch-1 KV cache: a head is computed from the longest prefix it shares
    with the previous head, then the tails run as one left-padded batch on copies of its cache.
    Only the logits that are needed leave the model (`logits_to_keep`).
  * Greedy `generate_until` decodes the prefilled rows together, `batch_size` rows at a time
    (batches of several heads are merged by left-padding their caches); a row leaves the batch
    when its text contains a stop sequence, it emits an EOS token, or it reaches `max_gen_toks`.
Tokenization, truncation, stop handling and post-processing are HFLM's own (tok_encode,
normalize_gen_kwargs, handle_stop_sequences, postprocess_generated_text), so scores match HFLM's
up to floating-point summation order (tests/test_prefix_lm.py compares the two). Sampling
requests, and models whose cache is not a plain per-layer K/V (sliding windows, recurrent
layers), go to HFLM's code unchanged.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from pipeline.decode.cache import cache_kwarg

# Cost of a forward pass ~ CALL_COST + TOKEN_COST * rows * width (seconds, 2-core CPU, SmolLM2-135M
# in float32). Only the ratio (one call ~ 50 tokens) steers the plan.
CALL_COST = 0.11
TOKEN_COST = 0.0023
# A decode batch holds at most this many cached positions (rows x padded length): every step
# reads the whole cache, so 40 rows of a 1k-token haystack decoded slower together than in
# batches of ~16.
DECODE_KV_TOKENS = 16384


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def forward_kwargs(model) -> tuple[str, bool]:
    """The forward's name for the cache argument, and whether it takes `logits_to_keep`."""
    return cache_kwarg(model), "logits_to_keep" in inspect.signature(model.forward).parameters


def _cache(kv: list[tuple[torch.Tensor, torch.Tensor]] | None):
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=kv) if kv else DynamicCache()


@contextlib.contextmanager
def gqa_attention(device: torch.device):
    """On CPU, let transformers hand grouped-query K/V to torch's SDPA as they are
    (enable_gqa) even with a padding mask, instead of first repeating them per query head: with
    SmolLM2's 3 KV heads for 9 query heads a masked decode step of 16 rows x 1k positions took
    1.85 s in 30 layers with the copies, 0.13 s without (same output). transformers keeps the
    copies when there is a mask because on CUDA that path can fall back to the slow math kernel,
    so the switch is made for CPU only and undone afterwards."""
    key = "TRANSFORMERS_SDPA_FORCE_GQA"
    old = os.environ.get(key)
    if device.type == "cpu":
        os.environ[key] = "1"
    try:
        yield
    finally:
        if device.type == "cpu":
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _decode_cache(kv: list[tuple[torch.Tensor, torch.Tensor]], room: int):
    """A DynamicCache whose layers hold `kv` in buffers with `room` free positions: decoding
    writes each new position in place instead of re-concatenating the whole cache every step."""
    from transformers.cache_utils import DynamicLayer

    class Preallocated(DynamicLayer):
        def __init__(self, k, v):
            super().__init__()
            b, h, n, d = k.shape
            self.buf_k, self.buf_v = k.new_empty(b, h, n + room, d), v.new_empty(b, h, n + room, d)
            self.buf_k[:, :, :n], self.buf_v[:, :, :n] = k, v
            self.n, self.is_initialized, self.device = n, True, k.device
            self._views()

        def _views(self):
            self.keys, self.values = self.buf_k[:, :, :self.n], self.buf_v[:, :, :self.n]

        def update(self, key_states, value_states, *args, **kwargs):
            t = key_states.shape[-2]
            if self.n + t > self.buf_k.shape[2]:
                raise RuntimeError("decode cache overflow")
            self.buf_k[:, :, self.n:self.n + t] = key_states
            self.buf_v[:, :, self.n:self.n + t] = value_states
            self.n += t
            self._views()
            return self.keys, self.values

        def batch_select_indices(self, indices):
            self.buf_k, self.buf_v = self.buf_k[indices], self.buf_v[indices]
            self._views()

    cache = _cache(None)
    cache.layers = [Preallocated(k, v) for k, v in kv]
    return cache


def _kv_of(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _batch_cost(head: int, lengths: list[int]) -> float:
    width = max(n - head for n in lengths)
    return (CALL_COST + TOKEN_COST * head if head else 0.0) + CALL_COST + TOKEN_COST * len(lengths) * width


def plan_batches(seqs: list[list[int]], need: list[int], max_rows: int) -> list[tuple[int, list[int]]]:
    """Cut requests into (head length, member indices) batches, in lexicographic order of `seqs`.
    Every member starts with the same `head` tokens and keeps at least `need[i]` tokens in its
    tail (the positions whose logits are read). Greedy: the next request joins the current batch
    when that costs less (by the cost model above) than giving it a batch of its own."""
    order = sorted(range(len(seqs)), key=lambda i: seqs[i])
    batches: list[tuple[int, list[int]]] = []
    members: list[int] = []
    head = 0
    for i in order:
        own = len(seqs[i]) - need[i]
        if members:
            joined = min(head, own, common_prefix(seqs[members[-1]], seqs[i]))
            lengths = [len(seqs[j]) for j in members]
            if len(members) < max_rows and _batch_cost(joined, lengths + [len(seqs[i])]) <= \
                    _batch_cost(head, lengths) + _batch_cost(own, [len(seqs[i])]):
                members.append(i)
                head = joined
                continue
            batches.append((head, members))
        members, head = [i], own
    if members:
        batches.append((head, members))
    return batches


@dataclass
class Rows:
    """A batch after prefill: its cache, attention mask, next position and tokens per row."""
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor      # [rows, cached length]; 0 on padding
    position: torch.Tensor  # [rows]: the position of the next token
    ids: list[int]          # request index per row


class PrefixWalk:
    """One batch-1 KV cache moved from head to head, and the batches run on top of it.
    `fwd` is forward_kwargs(model), worked out once per model by the caller."""

    def __init__(self, model, device: torch.device, fwd: tuple[str, bool]):
        self.model, self.device = model, device
        self.tokens: list[int] = []
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.requested = 0   # prompt tokens asked for
        self.computed = 0    # prompt tokens that went through the model (pads not counted)
        self.calls = 0
        self._cache_kw, self._keep_arg = fwd

    def _forward(self, ids, positions, cache, keep: int, mask=None):
        kwargs = {self._cache_kw: cache, **({"logits_to_keep": keep} if self._keep_arg else {})}
        if mask is not None:
            kwargs["attention_mask"] = mask
        self.calls += 1
        return self.model(input_ids=ids, position_ids=positions, use_cache=True, **kwargs).logits[:, -keep:]

    def move_to(self, head: list[int]) -> None:
        """Make the cache cover exactly `head`, computing only what the previous head lacks."""
        keep = common_prefix(self.tokens, head)
        kv = [(k[:, :, :keep], v[:, :, :keep]) for k, v in self.kv] if keep and self.kv else None
        if keep < len(head):
            cache = _cache(kv)
            ids = torch.tensor([head[keep:]], dtype=torch.long, device=self.device)
            self._forward(ids, torch.arange(keep, len(head), device=self.device)[None], cache, keep=1)
            kv = _kv_of(cache)
            self.computed += len(head) - keep
        self.kv, self.tokens = kv, list(head)

    def branch(self, head: list[int], tails: list[list[int]], keep: int) -> tuple[torch.Tensor, Rows]:
        """Run `head + tail` for every tail: the head's cache once, the tails as one batch,
        left-padded so every row ends at the last column. Returns float32 logits
        [rows, keep, vocab] at each row's last `keep` positions, and the batch's state."""
        if head:
            self.move_to(head)
        h, rows = len(head), len(tails)
        width = max(map(len, tails))
        if not 1 <= keep <= width:  # rows whose tail is shorter than `keep` read pads there
            raise ValueError(f"cannot read {keep} logits from tails of at most {width} tokens")
        ids = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        mask = torch.zeros(rows, h + width, dtype=torch.long, device=self.device)
        mask[:, :h] = 1
        positions = torch.full((rows, width), h, dtype=torch.long, device=self.device)
        for r, tail in enumerate(tails):
            pad = width - len(tail)
            ids[r, pad:] = torch.tensor(tail, dtype=torch.long)
            mask[r, h + pad:] = 1
            positions[r, pad:] = torch.arange(h, h + len(tail))
        kv = [(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)) for k, v in self.kv] if h else None
        cache = _cache(kv)
        logits = self._forward(ids, positions, cache, keep, mask).float()
        self.requested += sum(h + len(t) for t in tails)
        self.computed += sum(map(len, tails))
        return logits, Rows(_kv_of(cache), mask, positions[:, -1] + 1, [])


def merge_rows(parts: list[Rows]) -> Rows:
    """Stack batches along the batch dimension, left-padding shorter caches."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.mask.shape[1] for p in parts)
    kv = []
    for layer in range(len(parts[0].kv)):
        ks, vs = [], []
        for p in parts:
            k, v = p.kv[layer]
            pad = (0, 0, width - k.shape[2], 0)
            ks.append(F.pad(k, pad))
            vs.append(F.pad(v, pad))
        kv.append((torch.cat(ks), torch.cat(vs)))
    mask = torch.cat([F.pad(p.mask, (width - p.mask.shape[1], 0)) for p in parts])
    return Rows(kv, mask, torch.cat([p.position for p in parts]), [i for p in parts for i in p.ids])


class PrefixCachedLM(HFLM):
    """HFLM with prefix-shared, batched prefill and batched greedy decoding (module docstring).
    `stats` counts prompt tokens requested and computed, forward calls, generated tokens, decode
    steps and the seconds spent in prefill and decode."""

    def __init__(self, pretrained, tokenizer, batch_size: int = 8, **kwargs):
        super().__init__(pretrained=pretrained, tokenizer=tokenizer, batch_size=batch_size, **kwargs)
        self._bs = max(1, int(batch_size))
        self.stats = {"prompt_tokens": 0, "computed_tokens": 0, "prefill_calls": 0, "generated_tokens": 0,
                      "decode_steps": 0, "prefill_seconds": 0.0, "decode_seconds": 0.0}
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        self._stop_ids = {i for i in [self.eot_token_id, *gen_eos] if i is not None}
        self.supported = self._plain_kv_cache()
        self._fwd = forward_kwargs(self.model)

    def _plain_kv_cache(self) -> bool:
        """Only caches made of plain per-layer K/V tensors can be cut and batched as done here."""
        from transformers import DynamicCache

        cfg = self.model.config
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        if getattr(text, "sliding_window", None) or any(
                t != "full_attention" for t in (getattr(text, "layer_types", None) or [])):
            return False
        return self.backend == "causal" and hasattr(DynamicCache(), "layers") \
            and getattr(self, "think_end_token", None) is None

    def _account(self, walk: PrefixWalk, prefill_s: float, decode_s: float = 0.0) -> None:
        self.stats["prompt_tokens"] += walk.requested
        self.stats["computed_tokens"] += walk.computed
        self.stats["prefill_calls"] += walk.calls
        self.stats["prefill_seconds"] += prefill_s
        self.stats["decode_seconds"] += decode_s

    # ------------------------------------------------------------------ log-likelihood

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        if not self.supported:
            return super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)
        inputs, need = [], []
        for _, ctx, cont in requests:
            if not ctx or not cont:
                raise ValueError("a log-likelihood request needs a non-empty context and continuation")
            inputs.append((ctx + cont)[-(self.max_length + 1):][:-1])
            need.append(len(cont))
        res: list = [None] * len(requests)
        walk = PrefixWalk(self.model, self.device, self._fwd)
        start = time.perf_counter()
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                   desc="Running loglikelihood requests (prefix-shared)")
        with torch.inference_mode(), gqa_attention(self.device):
            for head, members in plan_batches(inputs, need, self._bs):
                keep = max(need[i] for i in members)
                logits, _ = walk.branch(inputs[members[0]][:head], [inputs[i][head:] for i in members], keep)
                for row, i in enumerate(members):
                    request_str, _, cont = requests[i]
                    logp = F.log_softmax(logits[row, keep - len(cont):], dim=-1)
                    target = torch.tensor(cont, dtype=torch.long, device=logp.device)
                    answer = (float(logp.gather(1, target[:, None]).sum()),
                              bool((logp.argmax(-1) == target).all()))
                    res[i] = answer
                    if request_str is not None:
                        self.cache_hook.add_partial("loglikelihood", request_str, answer)
                bar.update(len(members))
        bar.close()
        self._account(walk, time.perf_counter() - start)
        return res

    # ------------------------------------------------------------------ generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        if not self.supported:
            return super().generate_until(requests, disable_tqdm)
        res: list = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        fallback = []
        for i, req in enumerate(requests):
            kwargs = normalize_gen_kwargs(req.args[1], self.max_gen_toks)
            greedy = not kwargs.get("do_sample") and not kwargs.get("temperature")
            # An empty prompt has no token to prefill from: HFLM's path handles it.
            if greedy and req.args[0] and set(kwargs) <= {"until", "max_gen_toks", "do_sample", "temperature"}:
                groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
            else:
                fallback.append(i)
        if fallback:
            for i, text in zip(fallback, super().generate_until([requests[i] for i in fallback], disable_tqdm)):
                res[i] = text
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        bar = tqdm(total=len(requests) - len(fallback), disable=disable_tqdm or self.rank != 0,
                   desc="Running generate_until requests (prefix-shared)")
        walk = PrefixWalk(self.model, self.device, self._fwd)
        prefill_s = decode_s = 0.0
        with torch.inference_mode(), gqa_attention(self.device):
            for idx in groups.values():
                kwargs = normalize_gen_kwargs(requests[idx[0]].args[1], self.max_gen_toks)
                until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
                max_gen = kwargs.pop("max_gen_toks")
                enc = [self.tok_encode(requests[i].args[0], left_truncate_len=self.max_length - max_gen)
                       for i in idx]
                pool: list[Rows] = []
                first: dict[int, int] = {}

                def flush():
                    nonlocal decode_s
                    t0 = time.perf_counter()
                    for i, toks in self._decode(merge_rows(pool), first, until, max_gen).items():
                        text = postprocess_generated_text(self.tok_decode(toks), stop=until, think_end_token=None)
                        res[i] = text
                        self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    decode_s += time.perf_counter() - t0
                    bar.update(sum(len(p.ids) for p in pool))
                    pool.clear()
                    first.clear()

                for head, members in plan_batches(enc, [1] * len(enc), self._bs):
                    rows_after = sum(len(p.ids) for p in pool) + len(members)
                    width_after = max([p.mask.shape[1] for p in pool] + [max(len(enc[m]) for m in members)])
                    if pool and (rows_after > self._bs or rows_after * width_after > DECODE_KV_TOKENS):
                        flush()
                    t0 = time.perf_counter()
                    logits, rows = walk.branch(enc[members[0]][:head], [enc[m][head:] for m in members], keep=1)
                    rows.ids = [idx[m] for m in members]
                    first.update(zip(rows.ids, logits[:, -1].argmax(-1).tolist()))
                    pool.append(rows)
                    prefill_s += time.perf_counter() - t0
                if pool:
                    flush()
        bar.close()
        self._account(walk, prefill_s, decode_s)
        return res

    def _finished(self, toks: list[int], until: list[str], max_gen: int) -> bool:
        if len(toks) >= max_gen or toks[-1] in self._stop_ids:
            return True
        text = self.tokenizer.decode(toks, skip_special_tokens=False)
        return any(s and s in text for s in until)

    def _decode(self, rows: Rows, first: dict[int, int], until: list[str], max_gen: int) -> dict[int, list[int]]:
        """Greedy continuation of every row from its first token (already chosen at prefill)."""
        out = {i: [first[i]] for i in rows.ids}
        self.stats["generated_tokens"] += len(out)
        live = [j for j, i in enumerate(rows.ids) if not self._finished(out[i], until, max_gen)]
        if not live:
            return out
        kv, mask, pos = rows.kv, rows.mask, rows.position
        if len(live) < len(rows.ids):  # rows done at their first token; else no extra copy
            sel = torch.tensor(live, dtype=torch.long, device=self.device)
            kv, mask, pos = [(k[sel], v[sel]) for k, v in kv], mask[sel], pos[sel]
        cache = _decode_cache(kv, room=max_gen)
        alive = [rows.ids[j] for j in live]
        cur = torch.tensor([out[i][-1] for i in alive], dtype=torch.long, device=self.device)
        cache_kw, keep_arg = self._fwd
        kwargs = {cache_kw: cache, **({"logits_to_keep": 1} if keep_arg else {})}
        while alive:
            mask = torch.cat([mask, torch.ones(len(alive), 1, dtype=mask.dtype, device=mask.device)], 1)
            logits = self.model(input_ids=cur[:, None], attention_mask=mask, position_ids=pos[:, None],
                                use_cache=True, **kwargs).logits
            nxt = logits[:, -1].argmax(-1)
            self.stats["decode_steps"] += 1
            self.stats["generated_tokens"] += len(alive)
            keep = []
            for j, i in enumerate(alive):
                out[i].append(int(nxt[j]))
                if not self._finished(out[i], until, max_gen):
                    keep.append(j)
            if len(keep) < len(alive):
                sel = torch.tensor(keep, dtype=torch.long, device=self.device)
                cache.batch_select_indices(sel)
                mask, pos, nxt = mask[sel], pos[sel], nxt[sel]
                alive = [alive[j] for j in keep]
            pos = pos + 1
            cur = nxt
        return out
