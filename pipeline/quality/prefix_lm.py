"""An lm-eval model that computes each shared prompt prefix once and runs the rest in batches:
the quality stage's evaluator (`quality.evaluator: prefix`, the default).

    lm = PrefixCachedLM(pretrained=model, tokenizer=tok, batch_size=32)   # an HFLM, for simple_evaluate

Requests sorted by token ids sit next to those they share a prefix with (a question's options,
the questions about one haystack); `plan_batches` cuts them into batches of a shared head and
tails, `PrefixWalk` computes each head from the previous one's cache, and greedy generations are
decoded together. Tokenization, stops and post-processing are HFLM's, so scores match HFLM's up to
float rounding; sampling and caches that are not plain per-layer K/V run HFLM's own code
(docs/methods/quality-slices.md#the-evaluator).
"""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import time
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from pipeline.core.process import bars_off
from pipeline.decode.cache import cache_kwarg
from pipeline.quality import row_sizing
from pipeline.quality.row_sizing import (CPU_CALL_TOKENS, bucket_call_tokens, common_prefix, decode_kv_budget,
                                         free_memory, measure_call_tokens, plan_batches)


def forward_kwargs(model) -> tuple[str, bool]:
    """The forward's name for the cache argument, and whether it takes `logits_to_keep`."""
    return cache_kwarg(model), "logits_to_keep" in inspect.signature(model.forward).parameters


def _cache(kv: list[tuple[torch.Tensor, torch.Tensor]] | None):
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=kv) if kv else DynamicCache()


@contextlib.contextmanager
def gqa_attention(device: torch.device):
    """On CPU, let transformers hand grouped-query K/V to SDPA as they are (enable_gqa) even with
    a padding mask, instead of repeating them per query head (much faster decode steps, same
    output); not on CUDA, where that path can fall back to the slow math kernel."""
    key = "TRANSFORMERS_SDPA_FORCE_GQA"
    old = os.environ.get(key)
    if device.type == "cpu":
        os.environ[key] = "1"
    try:
        yield
    finally:
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
        # Built on the host and moved in one copy each, not one small copy per row.
        ids = torch.zeros(rows, width, dtype=torch.long)
        mask = torch.zeros(rows, h + width, dtype=torch.long)
        mask[:, :h] = 1
        positions = torch.full((rows, width), h, dtype=torch.long)
        for r, tail in enumerate(tails):
            pad = width - len(tail)
            ids[r, pad:] = torch.tensor(tail, dtype=torch.long)
            mask[r, h + pad:] = 1
            positions[r, pad:] = torch.arange(h, h + len(tail))
        ids, mask, positions = ids.to(self.device), mask.to(self.device), positions.to(self.device)
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


class StopCheck:
    """Which greedy rows are done after their latest token: `max_gen` tokens, a stop id (EOS), or
    a stop string in the text decoded with special tokens. Only each row's tail (at least what
    HFLM's MultiTokenEOSCriteria looks back) is decoded, all live rows in one batch_decode; a hit
    there is confirmed on the whole text."""

    def __init__(self, tokenizer, until: list[str], stop_ids: set[int], max_gen: int):
        self.tokenizer, self.stop_ids, self.max_gen = tokenizer, stop_ids, max_gen
        self.until = [s for s in until if s]
        self.window = max((len(s.encode("utf-8")) for s in self.until), default=0) + 2

    def __call__(self, rows: list[list[int]]) -> list[bool]:
        done = [len(t) >= self.max_gen or t[-1] in self.stop_ids for t in rows]
        look = [j for j, d in enumerate(done) if not d] if self.until else []
        if look:
            tails = self.tokenizer.batch_decode([rows[j][-self.window:] for j in look], skip_special_tokens=False)
            for j, text in zip(look, tails):
                if any(s in text for s in self.until):
                    whole = self.tokenizer.decode(rows[j], skip_special_tokens=False)
                    done[j] = any(s in whole for s in self.until)
        return done


# A loaded model's measured sizing constants, for the evaluators of later waves: the same batches.
_MEASURED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class PrefixCachedLM(HFLM):
    """HFLM with prefix-shared, batched prefill and batched greedy decoding (module docstring).
    `stats` counts tokens, calls, steps and seconds, and (once per model) the sizing constants
    `sizing` measured; `call_tokens` and `decode_kv_tokens` pin them."""

    def __init__(self, pretrained, tokenizer, batch_size: int = 8, call_tokens: int | None = None,
                 decode_kv_tokens: int | None = None, **kwargs):
        super().__init__(pretrained=pretrained, tokenizer=tokenizer, batch_size=batch_size, **kwargs)
        self._bs = max(1, int(batch_size))
        self.stats = {"prompt_tokens": 0, "computed_tokens": 0, "prefill_calls": 0, "generated_tokens": 0,
                      "decode_steps": 0, "prefill_seconds": 0.0, "decode_seconds": 0.0}
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        self._stop_ids = {i for i in [self.eot_token_id, *gen_eos] if i is not None}
        self.supported = self._plain_kv_cache()
        self._fwd = forward_kwargs(self.model)
        self._pinned = {k: int(v) for k, v in (("call_tokens", call_tokens), ("decode_kv_tokens", decode_kv_tokens))
                        if v is not None}
        if any(v < 1 for v in self._pinned.values()):
            raise ValueError(f"call_tokens and decode_kv_tokens must be >= 1, not {self._pinned}")
        self._sizing: dict | None = None

    def _plain_kv_cache(self) -> bool:
        """Only caches made of plain per-layer K/V tensors can be cut and batched as done here."""
        text = self.model.config.get_text_config()
        if getattr(text, "sliding_window", None) or any(
                t != "full_attention" for t in (getattr(text, "layer_types", None) or [])):
            return False
        return self.backend == "causal" and getattr(self, "think_end_token", None) is None

    def _account(self, walk: PrefixWalk, prefill_s: float, decode_s: float = 0.0) -> None:
        self.stats["prompt_tokens"] += walk.requested
        self.stats["computed_tokens"] += walk.computed
        self.stats["prefill_calls"] += walk.calls
        self.stats["prefill_seconds"] += prefill_s
        self.stats["decode_seconds"] += decode_s

    def sizing(self) -> dict:
        """`call_tokens` and `decode_kv_tokens` (pinned, or measured once per loaded model, with
        what they came from)."""
        if self._sizing is None:
            measured, fresh = {}, True
            if len(self._pinned) < 2:
                fresh = self.model not in _MEASURED
                if fresh:
                    _MEASURED[self.model] = self._measure()
                measured = _MEASURED[self.model]
            self._sizing = {**measured, **self._pinned}
            if fresh:
                self.stats.update(self._sizing)
        return self._sizing

    def _measure(self) -> dict:
        start = time.perf_counter()
        vocab = int(getattr(self.model.config.get_text_config(), "vocab_size", 0) or self.tokenizer.vocab_size)
        kv_bytes: list[int] = []

        def forward(rows: int, width: int) -> None:
            # Fixed token ids: what is timed must not depend on anything that varies.
            tail = [(17 + 31 * j) % vocab for j in range(width)]
            walk = PrefixWalk(self.model, self.device, self._fwd)
            _, state = walk.branch([], [tail] * rows, keep=1)
            if not kv_bytes:
                kv_bytes.append(sum(k.nbytes + v.nbytes for k, v in state.kv) // (rows * width))

        sync = (lambda: torch.cuda.synchronize(self.device)) if self.device.type == "cuda" else (lambda: None)
        with torch.inference_mode(), gqa_attention(self.device):
            m = measure_call_tokens(forward, sync)
            if not kv_bytes:
                forward(1, 16)
        free = free_memory(self.device)
        use_measured = self.device.type == "cuda" or row_sizing.MEASURE_ON_CPU
        return {"call_tokens": bucket_call_tokens(m["ratio"]) if use_measured else CPU_CALL_TOKENS,
                "call_tokens_measured": round(min(m["ratio"], 1e9), 1),
                "call_tokens_source": "measured" if use_measured else
                "CPU_CALL_TOKENS (a CPU's measurement moves with load; row_sizing.MEASURE_ON_CPU)",
                "call_ms": round(m["call_s"] * 1e3, 3), "token_ns": round(m["token_s"] * 1e9, 3),
                "kv_bytes_per_token": kv_bytes[0],
                "decode_kv_tokens": decode_kv_budget(self.device.type, kv_bytes[0], free),
                "calibration_seconds": round(time.perf_counter() - start, 3)}

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
        call_tokens = self.sizing()["call_tokens"]
        res: list = [None] * len(requests)
        walk = PrefixWalk(self.model, self.device, self._fwd)
        start = time.perf_counter()
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0 or bars_off(),
                   desc="Running loglikelihood requests (prefix-shared)")
        with torch.inference_mode(), gqa_attention(self.device):
            for head, members in plan_batches(inputs, need, self._bs, call_tokens):
                keep = max(need[i] for i in members)
                logits, _ = walk.branch(inputs[members[0]][:head], [inputs[i][head:] for i in members], keep)
                sums, greedy = [], []
                for row, i in enumerate(members):
                    cont = requests[i][2]
                    logp = F.log_softmax(logits[row, keep - len(cont):], dim=-1)
                    target = torch.tensor(cont, dtype=torch.long, device=logp.device)
                    sums.append(logp.gather(1, target[:, None]).sum())
                    greedy.append((logp.argmax(-1) == target).all())
                # One transfer to the host per batch, not two per row.
                values = torch.stack([torch.stack(sums), torch.stack(greedy).to(sums[0].dtype)]).tolist()
                for row, i in enumerate(members):
                    answer = (values[0][row], bool(values[1][row]))
                    res[i] = answer
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
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
        if not groups:
            return res
        cal = self.sizing()
        call_tokens, kv_budget = cal["call_tokens"], cal["decode_kv_tokens"]
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        bar = tqdm(total=len(requests) - len(fallback), disable=disable_tqdm or self.rank != 0 or bars_off(),
                   desc="Running generate_until requests (prefix-shared)")
        walk = PrefixWalk(self.model, self.device, self._fwd)
        prefill_s = decode_s = 0.0
        with torch.inference_mode(), gqa_attention(self.device):
            for idx in groups.values():
                kwargs = normalize_gen_kwargs(requests[idx[0]].args[1], self.max_gen_toks)
                until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
                max_gen = kwargs.pop("max_gen_toks")
                stop = StopCheck(self.tokenizer, until, self._stop_ids, max_gen)
                enc = [self.tok_encode(requests[i].args[0], left_truncate_len=self.max_length - max_gen)
                       for i in idx]
                pool: list[Rows] = []
                first: dict[int, int] = {}

                def flush():
                    nonlocal decode_s
                    t0 = time.perf_counter()
                    for i, toks in self._decode(merge_rows(pool), first, stop).items():
                        text = postprocess_generated_text(self.tok_decode(toks), stop=until, think_end_token=None)
                        res[i] = text
                        self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    decode_s += time.perf_counter() - t0
                    bar.update(sum(len(p.ids) for p in pool))
                    pool.clear()
                    first.clear()

                for head, members in plan_batches(enc, [1] * len(enc), self._bs, call_tokens):
                    rows_after = sum(len(p.ids) for p in pool) + len(members)
                    width_after = max([p.mask.shape[1] for p in pool] + [max(len(enc[m]) for m in members)])
                    if pool and (rows_after > self._bs or rows_after * width_after > kv_budget):
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

    def _decode(self, rows: Rows, first: dict[int, int], stop: StopCheck) -> dict[int, list[int]]:
        """Greedy continuation of every row from its first token (already chosen at prefill).
        Per step: one forward of the live rows, one transfer of their tokens to the host, one
        batched stop check (StopCheck); finished rows leave the cache."""
        out = {i: [first[i]] for i in rows.ids}
        self.stats["generated_tokens"] += len(out)
        done = stop([out[i] for i in rows.ids])
        live = [j for j, d in enumerate(done) if not d]
        if not live:
            return out
        kv, mask, pos = rows.kv, rows.mask, rows.position
        if len(live) < len(rows.ids):  # rows done at their first token; else no extra copy
            sel = torch.tensor(live, dtype=torch.long, device=self.device)
            kv, mask, pos = [(k[sel], v[sel]) for k, v in kv], mask[sel], pos[sel]
        cache = _decode_cache(kv, room=stop.max_gen)
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
            for i, t in zip(alive, nxt.tolist()):  # the step's one transfer to the host
                out[i].append(t)
            keep = [j for j, d in enumerate(stop([out[i] for i in alive])) if not d]
            if not keep:
                break
            if len(keep) < len(alive):
                sel = torch.tensor(keep, dtype=torch.long, device=self.device)
                cache.batch_select_indices(sel)
                mask, pos, nxt = mask[sel], pos[sel], nxt[sel]
                alive = [alive[j] for j in keep]
            pos = pos + 1
            cur = nxt
        return out
