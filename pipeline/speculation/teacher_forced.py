"""One teacher-forced pass of target and draft over a generated text -> its TextAcceptance.

    from pipeline.speculation.teacher_forced import score_text
    text = score_text(model, draft, prompt_ids, tokens, sampling, k_max, max_new_tokens)

One target forward gives p_t at every position; a ModelDraft's gives q_t and a_t = min(1, q_t(x_t) /
p_t(x_t)); an NgramDraft's acceptance is a [start, offset] matrix, 1 where proposal_s[i] == x_{s+i}
(docs/methods/acceptance.md).
"""
from __future__ import annotations

import numpy as np
import torch

from pipeline.core.stage import StageError
from pipeline.decode.cache import hf_model
from pipeline.decode.drafts import ModelDraft, NgramDraft
from pipeline.decode.sampling import SamplingParams, logits_to_probs
from pipeline.speculation.expected_rounds import TextAcceptance, model_draft_rows


def last_logits(model, ids: torch.Tensor, rows: int) -> torch.Tensor:
    """ids: [1, L] -> float32 logits [rows, V] of the last `rows` positions (no KV cache)."""
    out = hf_model(model)(input_ids=ids, use_cache=False, logits_to_keep=rows)
    return out.logits[0, -rows:].float()


@torch.inference_mode()
def score_text(model, draft, prompt_ids: list[int], tokens: list[int], sampling: SamplingParams, k_max: int,
               max_new_tokens: int) -> TextAcceptance:
    n = len(tokens)
    empty = np.zeros((0, k_max))
    if n < 2:  # no round ran: the prefill's token was the whole output (EOS first, or N = 1)
        return TextAcceptance(empty, empty, np.zeros(0, dtype=int), n, max_new_tokens)
    device = next(hf_model(model).parameters()).device
    seq = torch.tensor([list(prompt_ids) + list(tokens[:-1])], device=device)  # [1, T + n - 1]
    x = torch.tensor(tokens[1:], device=device)  # [n-1]: the tokens rounds emitted
    p = logits_to_probs(last_logits(model, seq, n - 1), sampling)  # [n-1, V]: row t-1 predicts x_t
    rows = torch.arange(n - 1, device=device)
    px = p[rows, x]
    if isinstance(draft, ModelDraft):
        q = draft.probs(last_logits(draft.model, seq, n - 1), sampling)  # [n-1, V]
        qx = q[rows, x]
        # p_t(x_t) > 0 for an emitted token in exact arithmetic; the clamp only guards rounding.
        a = torch.clamp(qx / px.clamp_min(1e-30), max=1.0)
        beta = torch.minimum(p, q).sum(-1)
        a, beta = a.double().cpu().numpy(), beta.double().cpu().numpy()
        return TextAcceptance(model_draft_rows(a, k_max), model_draft_rows(beta, k_max),
                              np.full(n - 1, k_max), n, max_new_tokens)
    if isinstance(draft, NgramDraft):
        full = np.asarray(list(prompt_ids) + list(tokens), dtype=np.int64)
        start0 = len(prompt_ids)  # a round at start s sees prompt + x_0..x_{s-1}
        p_host = p.cpu()
        accept, beta = np.zeros((n - 1, k_max)), np.zeros((n - 1, k_max))
        available = np.zeros(n - 1, dtype=int)
        for s in range(1, n):
            proposal = draft.lookup(full[: start0 + s], k_max)
            available[s - 1] = proposal.size
            for i, d in enumerate(proposal[: n - s]):  # offsets inside the text
                accept[s - 1, i] = float(d == tokens[s + i])
                beta[s - 1, i] = float(p_host[s + i - 1, int(d)])
        return TextAcceptance(accept, beta, available, n, max_new_tokens)
    raise StageError(f"acceptance: no teacher-forced scoring for a {type(draft).__name__} draft "
                     "(known: ModelDraft, NgramDraft)")
