"""The prefix evaluator's plans that need no model (pipeline/quality/prefix_lm.py): which requests
share a forward (`plan_batches`, a cost model of a call in tokens) and when a greedy row is done
(`StopCheck`, stop strings looked for in each row's decoded tail). Pure Python on token ids.
"""
from __future__ import annotations

from pipeline.quality.calibration import CPU_CALL_TOKENS


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _batch_cost(head: int, lengths: list[int], call_tokens: int) -> int:
    """A batch's cost in tokens: the head's call (when there is a head) and the tails' call of
    rows x padded width. Integers, so the plan's comparisons have no rounding to flip."""
    width = max(n - head for n in lengths)
    return (call_tokens + head if head else 0) + call_tokens + len(lengths) * width


def plan_batches(seqs: list[list[int]], need: list[int], max_rows: int,
                 call_tokens: int = CPU_CALL_TOKENS) -> list[tuple[int, list[int]]]:
    """Cut requests into (head length, member indices) batches, in lexicographic order of `seqs`.
    Every member starts with the same `head` tokens and keeps at least `need[i]` tokens in its
    tail (the positions whose logits are read). Greedy: the next request joins the current batch
    when that costs less (by the cost model above, a call being worth `call_tokens` tokens) than
    giving it a batch of its own."""
    order = sorted(range(len(seqs)), key=lambda i: seqs[i])
    batches: list[tuple[int, list[int]]] = []
    members: list[int] = []
    head = 0
    for i in order:
        own = len(seqs[i]) - need[i]
        if members:
            joined = min(head, own, common_prefix(seqs[members[-1]], seqs[i]))
            lengths = [len(seqs[j]) for j in members]
            if len(members) < max_rows and _batch_cost(joined, lengths + [len(seqs[i])], call_tokens) <= \
                    _batch_cost(head, lengths, call_tokens) + _batch_cost(own, [len(seqs[i])], call_tokens):
                members.append(i)
                head = joined
                continue
            batches.append((head, members))
        members, head = [i], own
    if members:
        batches.append((head, members))
    return batches


# ------------------------------------------------------------------ stop strings


class StopCheck:
    """Which greedy rows are done after their latest token: `max_gen` tokens, a stop id (EOS),
    or a stop string in the text decoded with special tokens (what the evaluator always checked).

    Incremental: a stop string that was not in a row's text before its latest token and is now
    must overlap that token's text, so only a tail of the row is decoded, all live rows in one
    batch_decode: the last (longest stop string in UTF-8 bytes + 2) tokens. Every token adds at
    least one byte of text, so a stop string spread over as many tokens as it has bytes (a "\\n\\n"
    emitted as two "\\n", or a byte-fallback character) still lies inside the tail; the 2 spare
    tokens absorb what decoding a tail alone changes at its start (a partial UTF-8 character,
    the leading space a SentencePiece decoder drops). lm-eval's HFLM looks back only
    len(tokens of the stop string) + 2 tokens (MultiTokenEOSCriteria), so this sees at least what
    it sees. A hit in the tail is confirmed on the whole text, so a row never stops on a string
    its text lacks. What a row returns is unchanged by where it stops: the caller cuts the whole
    decoded text at the first stop string (postprocess_generated_text), as HFLM does, and a row
    that decoded further (a miss) is cut at the same place."""

    def __init__(self, tokenizer, until: list[str], stop_ids: set[int], max_gen: int):
        self.tokenizer, self.stop_ids, self.max_gen = tokenizer, stop_ids, max_gen
        self.until = [s for s in until if s]
        self.window = max((len(s.encode("utf-8")) for s in self.until), default=0) + 2

    def contains(self, toks: list[int]) -> bool:
        """The whole-text test."""
        text = self.tokenizer.decode(toks, skip_special_tokens=False)
        return any(s in text for s in self.until)

    def __call__(self, rows: list[list[int]]) -> list[bool]:
        done = [len(t) >= self.max_gen or t[-1] in self.stop_ids for t in rows]
        look = [j for j, d in enumerate(done) if not d] if self.until else []
        if look:
            tails = self.tokenizer.batch_decode([rows[j][-self.window:] for j in look], skip_special_tokens=False)
            for j, text in zip(look, tails):
                if any(s in text for s in self.until):
                    done[j] = self.contains(rows[j])
        return done
