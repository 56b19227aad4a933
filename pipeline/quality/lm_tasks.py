"""Standard lm-eval tasks as quality slices (`quality.tasks`), the way their users read them.

An entry is a task, group or tag lm-eval knows by name, or a path to task YAML; a group or tag is
one slice whose subtasks are its groups. Its documents are put in a seeded cluster order like a
built-in slice's (`NamedSlice.rows`, `ends` where each cluster ends), and a look asks lm-eval only
for the documents a model lacks (`subset`), in one call of exactly them (a task draws few-shot
examples per call). Filters, metrics and clusters: docs/methods/quality-slices.md.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipeline.core.quality_config import QualityConfig
from pipeline.core.stage import StageError, progress
from pipeline.quality.items import order_items

# Fields that hold a passage several documents are asked about (race: article, squad: context,
# xnli/anli: premise, boolq/multirc: passage, ...).
PASSAGE_FIELDS = ("context", "passage", "article", "paragraph", "story", "document", "premise", "ctx")


@dataclass
class Leaf:
    """One lm-eval task inside a slice."""
    name: str
    size: int
    metric: str           # primary metric
    filter: str           # primary filter
    filters: list[str]
    doc_ids: list[int] = field(default_factory=list)  # the documents to run, ascending (lm-eval's order)
    metrics: list[str] = field(default_factory=list)  # every metric it reports (higher_is_better's keys)


@dataclass
class NamedSlice:
    name: str             # the slice name (what quality/<variant>/<name>.jsonl is called)
    request: str          # what simple_evaluate is asked for (without `tasks`)
    leaves: list[Leaf]
    cluster_by: str | None
    # The task index it was found in: (lm-eval's own tasks too, local YAML directories).
    index: tuple[bool, tuple[str, ...]] = (True, ())
    # The slice's documents in scoring order, as JSONL (id, cluster, slice, group, subtask, doc_id,
    # prompt: the document itself), and the item counts at which each cluster ends.
    rows: bytes = b""
    ends: list[int] = field(default_factory=list)
    # leaf name -> lm-eval's Task, loaded once (its data with it); not part of what was scored.
    tasks: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def n_max(self) -> int:
        return sum(len(leaf.doc_ids) for leaf in self.leaves)

    def info(self) -> dict:
        return {"request": self.request, "include_paths": list(self.index[1]), "cluster_by": self.cluster_by,
                "items": self.n_max, "order": "seeded cluster order",
                "subtasks": {leaf.name: {"items": len(leaf.doc_ids), "of": leaf.size,
                                         "primary": f"{leaf.metric},{leaf.filter}", "filters": leaf.filters}
                             for leaf in self.leaves}}


@contextlib.contextmanager
def quiet():
    """lm-eval and datasets log a lot at INFO/WARNING; keep the stage's stderr to progress lines."""
    loggers = [logging.getLogger(n) for n in ("lm-eval", "lm_eval", "datasets", "evaluate")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


# ------------------------------------------------------------------ resolving names


@functools.lru_cache(maxsize=4)
def task_manager(with_defaults: bool, include_paths: tuple[str, ...] = ()):
    """lm-eval's task index, built once per process: indexing lm-eval's own ~27k task YAMLs took
    about 12 s, and simple_evaluate builds a fresh index on every call unless given one."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=with_defaults, include_path=list(include_paths) or None)


def _yaml_name(path: Path) -> str | None:
    """The task or group a YAML file defines (its `!function` tags are not resolved here)."""
    import yaml

    class Loose(yaml.SafeLoader):
        pass

    Loose.add_multi_constructor("!", lambda loader, suffix, node: None)
    try:
        cfg = yaml.load(path.read_text(), Loader=Loose) or {}
    except (OSError, yaml.YAMLError):
        return None
    name = cfg.get("group") or cfg.get("task")
    return name if isinstance(name, str) else None


def split_entries(entries: list[str]) -> list[tuple[str, str, str | None]]:
    """(slice name, lm-eval name, include path) per entry: a path to a YAML names its task."""
    out = []
    for entry in entries:
        path = Path(entry).expanduser()
        if entry.endswith((".yaml", ".yml")) or path.is_file():
            name = _yaml_name(path) if path.is_file() else None
            out.append((name or entry, name or entry, str(path.resolve().parent)))
        else:
            out.append((entry, entry, None))
    return out


def _index(parsed: list[tuple[str, str, str | None]]):
    """The task index the entries are looked up in, and (with lm-eval's own tasks?, paths)."""
    paths = tuple(sorted({p for _, _, p in parsed if p}))
    # lm-eval's own index (slow to build) only when a name is not among the local YAMLs.
    defaults = not paths or any(name not in task_manager(False, paths).all_tasks for _, name, _ in parsed)
    return task_manager(defaults, paths), (defaults, paths)


def unknown(entries: list[str]) -> dict[str, str]:
    """{entry: why} for the entries lm-eval's task index (with the local YAMLs) does not know: a
    typo, or a YAML path that defines nothing. Reads the index only (no data is loaded)."""
    if not entries:
        return {}
    parsed = split_entries(entries)
    with quiet():
        manager, _ = _index(parsed)
    return {entry: "not a task, group or tag lm-eval knows" + (f" (nothing named so in {path})" if path else "")
            for entry, (_, name, path) in zip(entries, parsed) if name not in manager.all_tasks}


def resolve(entries: list[str], qcfg=None, seed: int = 0) -> tuple[list[NamedSlice], dict[str, str]]:
    """The listed tasks that can run here, and {entry: why not} for the others (one line each).
    An unknown name is skipped here too; the stage refuses it first (`unknown`)."""
    if not entries:
        return [], {}
    qcfg = qcfg or QualityConfig()
    parsed = split_entries(entries)
    manager, (defaults, paths) = _index(parsed)
    usable, skipped = [], {}
    for entry, (slice_name, name, path) in zip(entries, parsed):
        if name not in manager.all_tasks:
            skipped[entry] = "not a task lm-eval knows" + (f" (nothing named so in {path})" if path else "")
        else:
            try:
                with quiet():  # loads (and caches) the data
                    tasks = list(manager.load([name])["tasks"].values())
            except Exception as e:  # datasets raises many kinds when the hub is unreachable
                skipped[entry] = f"its data is not reachable ({type(e).__name__})"
            else:
                named = _build(slice_name, name, (defaults, paths), tasks, qcfg, seed)
                if isinstance(named, str):
                    skipped[entry] = named
                else:
                    usable.append(named)
        if entry in skipped:
            progress(f"quality: skipping lm-eval task '{entry}': {skipped[entry]}")
    return usable, skipped


def _build(slice_name: str, name: str, index: tuple[bool, tuple[str, ...]], tasks: list, qcfg, seed: int):
    """The slice, or a one-line reason it cannot be gated."""
    leaves = []
    primary = qcfg.task_primary.get(slice_name, "")
    for task in tasks:
        higher = task.higher_is_better()
        filters = [f.name for f in task._filters]
        want_metric, _, want_filter = (qcfg.task_primary.get(task.config.task, primary) + ",").partition(",")
        want_filter = want_filter.rstrip(",")
        if want_metric:
            if want_metric not in higher:
                raise StageError(f"quality.task_primary: '{task.config.task}' has no metric '{want_metric}' "
                                 f"(it reports: {', '.join(higher)})")
            if not higher[want_metric]:
                raise StageError(f"quality.task_primary: '{want_metric}' of '{task.config.task}' is "
                                 f"lower-is-better; the gate needs a higher-is-better score")
            metric = want_metric
        elif "acc_norm" in higher:
            metric = "acc_norm"
        else:
            metric = next((m for m, up in higher.items() if up), None)
            if metric is None:
                return f"'{task.config.task}' reports no higher-is-better metric ({', '.join(higher)})"
        if want_filter and want_filter not in filters:
            raise StageError(f"quality.task_primary: '{task.config.task}' has no filter '{want_filter}' "
                             f"(it has: {', '.join(filters)})")
        leaves.append(Leaf(task.config.task, len(task.eval_docs), metric, want_filter or filters[0], filters,
                           metrics=list(higher)))
    cluster_by = qcfg.task_clusters.get(slice_name) or _passage_field(tasks)
    if cluster_by and cluster_by != "doc_id":
        missing = [t.config.task for t in tasks if cluster_by not in (t.eval_docs[0] if len(t.eval_docs) else {})]
        if missing:
            raise StageError(f"quality.task_clusters: documents of {', '.join(missing)} have no field '{cluster_by}'")
    s = NamedSlice(slice_name, name, leaves, cluster_by, index, tasks={t.config.task: t for t in tasks})
    n_max = min([x for x in (qcfg.items_for(slice_name), qcfg.max_items) if x is not None], default=None)
    _choose_docs(s, n_max, seed)
    if not s.n_max:
        return "it has no documents to score"
    return s


def _choose_docs(s: NamedSlice, n_max: int | None, seed: int) -> None:
    """The slice's documents in scoring order (s.rows, s.ends: items.order_items over every
    document of every subtask, the first n_max of them) and each subtask's share (leaf.doc_ids)."""
    pool = []
    for leaf in s.leaves:
        docs = s.tasks[leaf.name].eval_docs
        for doc_id in range(leaf.size):
            doc = docs[doc_id]
            rid = _rid(leaf, doc_id)
            pool.append({"id": rid, "cluster": _cluster(s, leaf, doc_id, doc) or rid, "slice": s.name,
                         "group": leaf.name if len(s.leaves) > 1 else None, "subtask": leaf.name,
                         "doc_id": doc_id, "prompt": json.dumps(doc, sort_keys=True, default=str)})
    blob = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in pool).encode()
    s.rows, s.ends = order_items(blob, seed, s.name, len(pool) if n_max is None else n_max)
    chosen: dict[str, list[int]] = {leaf.name: [] for leaf in s.leaves}
    for line in s.rows.splitlines():
        row = json.loads(line)
        chosen[row["subtask"]].append(int(row["doc_id"]))
    for leaf in s.leaves:
        leaf.doc_ids = sorted(chosen[leaf.name])  # lm-eval runs `samples` in file order


def _rid(leaf: Leaf, doc_id: int) -> str:
    return f"{leaf.name}-{doc_id:05d}"


def subset(s: NamedSlice, ids) -> NamedSlice:
    """The slice restricted to the items `ids` (every subtask kept, as the records' groups and
    score names depend on the whole slice; a subtask with none of them runs nothing)."""
    want: dict[str, set[int]] = {}
    by_id = {_rid(leaf, d): (leaf.name, d) for leaf in s.leaves for d in leaf.doc_ids}
    for i in ids:
        if i not in by_id:
            raise StageError(f"quality: '{i}' is not an item of lm-eval task '{s.name}'")
        leaf_name, d = by_id[i]
        want.setdefault(leaf_name, set()).add(d)
    leaves = [replace(leaf, doc_ids=sorted(want.get(leaf.name, ()))) for leaf in s.leaves]
    return replace(s, leaves=leaves, rows=b"", ends=[])


def cost_weight(s: NamedSlice, tokenizer, sample: int = 32) -> float:
    """An item's prior cost relative to the built-in slices' (items.cost_weights): the first
    documents' prompt tokens times one plus the few-shot examples, plus twice max_gen_toks."""
    weights = []
    for leaf in s.leaves:
        task = s.tasks[leaf.name]
        if not leaf.doc_ids:
            continue
        docs = task.eval_docs
        texts = []
        for d in leaf.doc_ids[:max(sample // len(s.leaves), 1)]:
            try:
                text = task.doc_to_text(docs[d])
            except Exception:  # a task's own function; only a prior
                text = None
            texts.append(text if isinstance(text, str) else json.dumps(docs[d], default=str))
        prompt = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts) / max(len(texts), 1)
        shots = task.config.num_fewshot or 0
        gen = 0
        if task.config.output_type == "generate_until":
            gen = int((task.config.generation_kwargs or {}).get("max_gen_toks", 256))
        weights.append(1.0 + prompt * (1 + shots) + 2.0 * gen)
    return round(sum(weights) / len(weights), 1) if weights else 1.0


def _passage_field(tasks: list) -> str | None:
    for name in PASSAGE_FIELDS:
        for task in tasks:
            docs = task.eval_docs
            if len(docs) and name in docs[0]:
                values = [json.dumps(d[name], sort_keys=True, default=str) for d in docs]
                if len(set(values)) < len(values):
                    return name
    return None


# ------------------------------------------------------------------ records


def samples_request(named: list[NamedSlice]) -> dict[str, list[int]]:
    """simple_evaluate's `samples`: the documents to run, per subtask (ascending; a subtask with
    none is left out: lm-eval reads an empty list as "all")."""
    return {leaf.name: list(leaf.doc_ids) for s in named for leaf in s.leaves if leaf.doc_ids}


def _key(metric: str, filt: str, leaf: Leaf) -> str:
    return metric if len(leaf.filters) == 1 else f"{metric},{filt}"


def _number(x) -> bool:
    return isinstance(x, (int, float, bool))


def records(s: NamedSlice, samples: dict[str, list[dict]]) -> list[dict] | str:
    """One record per document (not per filter), or a one-line reason the slice cannot be gated
    (its headline metric is not a per-item number, e.g. a corpus-level BLEU)."""
    out = []
    for leaf in s.leaves:
        by_doc: dict[int, dict[str, dict]] = {}
        for sample in samples.get(leaf.name, []):
            by_doc.setdefault(int(sample["doc_id"]), {})[sample.get("filter", "none")] = sample
        for doc_id in sorted(by_doc):
            per_filter = by_doc[doc_id]
            primary = per_filter.get(leaf.filter)
            if primary is None or not _number(primary.get(leaf.metric)):
                return f"'{leaf.name}': '{leaf.metric}' is not a per-item number"
            scores = {_key(m, f, leaf): float(smp[m]) for f, smp in per_filter.items()
                      for m in smp.get("metrics", []) if _number(smp.get(m))}
            rid = _rid(leaf, doc_id)
            rec = {"id": rid, "cluster": _cluster(s, leaf, doc_id, primary.get("doc")) or rid, "slice": s.name,
                   "group": leaf.name if len(s.leaves) > 1 else None, "prompt_hash": primary.get("prompt_hash"),
                   "metric": _key(leaf.metric, leaf.filter, leaf),
                   "score": float(primary[leaf.metric]), "scores": scores, "prediction": _text(primary),
                   "target": str(primary.get("target"))}
            if len(per_filter) > 1:
                rec["predictions"] = {f: _text(smp) for f, smp in per_filter.items()}
            out.append(rec)
    shared = set.intersection(*(set(r["scores"]) for r in out)) if out else set()
    # The names every subtask reports (a look may hold documents of only some of them, and its
    # records must carry the names the whole slice's would).
    every = [{_key(m, f, leaf) for m in leaf.metrics for f in leaf.filters} for leaf in s.leaves if leaf.metrics]
    if every and len(every) == len(s.leaves):
        shared &= set.intersection(*every)
    for r in out:  # one set of score names per slice (subtasks of a group may report more)
        r["scores"] = {k: v for k, v in r["scores"].items() if k in shared}
    return out


def _text(sample: dict) -> str | None:
    """A sample's filtered response, where it is text."""
    resp = sample.get("filtered_resps")
    return resp[0] if isinstance(resp, list) and resp and isinstance(resp[0], str) else None


def _cluster(s: NamedSlice, leaf: Leaf, doc_id: int, doc) -> str | None:
    if s.cluster_by == "doc_id":
        return f"{s.name}:doc-{doc_id}"
    if s.cluster_by and isinstance(doc, dict) and s.cluster_by in doc:
        value = json.dumps(doc[s.cluster_by], sort_keys=True, default=str)
        return f"{leaf.name}:{s.cluster_by}-{hashlib.sha1(value.encode()).hexdigest()[:12]}"
    return None
