"""The order in which a slice's items are scored in waves, and the looks it allows.

    from pipeline.quality.waves import order_items
    blob, ends = order_items(pool_blob, seed=0, slice_name="bfcl", n_max=240)

Group-sequential gating (pipeline/gate/looks.py) scores a slice `quality.wave_items` at a time,
the reference and every variant on the same items, and stops a cell once a look settles it. For
the looks to be a random sample at every size, the slice's items are put in a fixed random order
(seeded by the run's seed and the slice's name) once, written to quality/data/<slice>.jsonl in
that order, and every model scores a prefix of it.

The order permutes clusters, not items (a cluster: a shared `cluster` label or an identical
prompt, as the gate clusters), and a cluster's items sit together, so a look never splits one:
the design effect is the same at every look and the information fraction is the items' share,
which the spending function assumes. When the budget holds fewer items than the pool has
clusters (BFCL's 1,240 items fall in 762 clusters, one of 206 items sharing a function doc), the
slice takes one item (a seeded choice) from each of the first `n_max` clusters instead: independent
items, the most information per item; a cluster of 206 items could otherwise never be shown clean
(pipeline/stats/paired.py: cluster_split) and no identical copy could pass. The same when the
clusters have unequal sizes, whatever the budget (gpu.yaml's 1,000 BFCL items would otherwise take
whole clusters, the 76-item one among them, and an identical copy's bound would stay at -0.13):
at most one item per cluster. Otherwise (clusters of one size: the long-context haystacks) whole
clusters are taken in order while they fit in `n_max`. The stage takes this selection for one
look too, so a slice is the same sample whatever `wave_items` says.

What that means for the decision: on a slice with unequal clusters each cluster counts once (the
issue's "cap a cluster's weight", at one item), so the gate's estimand there is the mean
difference over clusters, not over items. A regression confined to a few big clusters counts by
its clusters: with the item-weighted difference at -0.05 but the damage in 5 clusters of 20
among 900 singletons, the cluster-weighted difference is about -0.022 and the gate passes it
(README, tests/sim_gate_rates.py --sequential). That is the price of a bound that holds: a few
big clusters cannot estimate their own variance, and taken whole they could only enter at their
worst case, where no copy, identical or not, could pass.
"""
from __future__ import annotations

import hashlib
import json
import random

from pipeline.stats.paired import merge_clusters


def order_items(blob: bytes, seed: int, slice_name: str, n_max: int) -> tuple[bytes, list[int]]:
    """(the first items of the slice's seeded cluster order, at most n_max, as JSONL bytes; the
    item counts at which each cluster ends)."""
    lines = blob.splitlines(keepends=True)
    rows = [json.loads(line) for line in lines]
    labels = [r.get("cluster") for r in rows]
    prompts = [hashlib.sha256(str(r.get("prompt", "")).encode()).hexdigest() if "prompt" in r else None
               for r in rows]
    codes = merge_clusters(len(rows), labels, prompts)
    members: dict[int, list[int]] = {}
    for i, c in enumerate(codes.tolist()):
        members.setdefault(c, []).append(i)
    rng = random.Random(f"waves:{slice_name}:{seed}")
    clusters = list(members.values())  # in order of first appearance: deterministic
    rng.shuffle(clusters)
    chosen: list[list[int]] = []
    sizes = {len(c) for c in clusters}
    if max(sizes) > 1 and (len(clusters) >= n_max or len(sizes) > 1):
        chosen = [[rng.choice(c)] for c in clusters[:n_max]]
    else:
        total = 0
        for c in clusters:
            if total + len(c) > n_max:
                break
            chosen.append(c)
            total += len(c)
    out, ends = [], []
    for c in chosen:
        out += [lines[i] if lines[i].endswith(b"\n") else lines[i] + b"\n" for i in c]
        ends.append(len(out))
    return b"".join(out), ends
