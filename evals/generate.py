"""Deterministic generators for specq's built-in task slices.

    python -m evals.generate            # rewrite evals/data/<slice>.jsonl (the shipped items)
    python -m evals.generate --check    # exit 1 if a shipped file differs from a fresh generation

Item i of a slice comes from its own random stream, seeded by ("<slice>", seed, i), so the first n
items never change when more are asked for: the shipped file is a prefix of any larger set, and a
run that needs more items (GPU config) or other context lengths regenerates them exactly.

Every item has: id, slice, cluster (what items share that can make them fail together: the
haystack on long_context; elsewhere each item is its own, since no two items of a slice share a
prompt), template (the fixed kind/template, a stratum not a cluster), group (language or
context length; null if none), prompt (the full user message, few-shot examples included: the
embedded 135M model needs them), target (string), answer_type, and slice-specific keys.
Items are deliberately very easy: the reference score must sit inside 20-90% for the gate to have
anything to detect.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
SEED = 0
# Items shipped per slice (GPU-sized runs regenerate more at run time).
SHIPPED = {"reasoning": 200, "language": 200, "long_context": 60, "calibration": 200, "tool_args": 200}
LONG_CONTEXT_LENGTHS = [512, 1024, 2048]
LONG_CONTEXT_DEPTHS = [0.1, 0.5, 0.9]
# Filler length is counted with a fixed characters-per-token ratio (measured for the filler below
# with the SmolLM2 tokenizer: 4.67) so the shipped data does not depend on a tokenizer; the stage
# records the real token counts. About 50 tokens go to the instruction, fact and question.
CHARS_PER_TOKEN = 4.65
QUESTION_TOKENS = 50
# Facts about keys nobody asks for, beyond the block's own needles (each item already has
# len(depths) - 1 other facts of its kind in the haystack: the other items' needles).
DISTRACTORS = 2

NAMES = ["Tom", "Anna", "Sam", "Lisa", "Ben", "Mia", "Max", "Emma", "Leo", "Zoe"]
OBJECTS = ["apples", "books", "pens", "cards", "balls", "cups", "coins", "eggs"]


def _rng(slice_name: str, seed: int, i: int | str) -> random.Random:
    return random.Random(f"{slice_name}:{seed}:{i}")


MAX_DRAWS = 2000  # draws for a question no earlier item of the slice asked, before giving up


def _shots_and_question(slice_name: str, seed: int, i: int, kind: str, make, k: int, seen: set):
    """`k` distinct few-shot examples fixed per `kind` (every item of a kind shows the same ones, as
    lm-eval's fixed few-shot prompts do, so those items share a prompt prefix the evaluator
    computes once) and the item's own question, drawn again while it repeats a shot's or an
    earlier item's question: no two items of a slice share a prompt (duplicates score alike
    under greedy decoding, so they would count one measurement several times). `seen` holds the
    questions already asked; items are made in order, so item i depends only on items < i and
    the first n items never change when more are asked for."""
    shot_rng = _rng(f"{slice_name}-shots", seed, kind)
    shots: list = []
    while len(shots) < k:
        shot = make(shot_rng)
        if shot[0] not in [s[0] for s in shots]:
            shots.append(shot)
    taken = seen | {s[0] for s in shots}
    r = _rng(slice_name, seed, i)
    for _ in range(MAX_DRAWS):
        question = make(r)
        if question[0] not in taken:
            seen.add(question[0])
            return shots, question
    raise ValueError(f"{slice_name}: no new '{kind}' question in {MAX_DRAWS} draws after {len(seen)} "
                     f"items; its templates are nearly used up, ask for fewer items")


def _qa_prompt(instruction: str, shots: list[tuple[str, str]], question: str) -> str:
    lines = [instruction, ""]
    for q, a in shots:
        lines += [f"Q: {q}", f"A: {a}", ""]
    lines += [f"Q: {question}", "A:"]
    return "\n".join(lines)


# ------------------------------------------------------------------ reasoning

def _r_add(r):
    n, o, a, b = r.choice(NAMES), r.choice(OBJECTS), r.randint(1, 5), r.randint(1, 4)
    return f"{n} has {a} {o}. {n} gets {b} more {o}. How many {o} does {n} have now?", str(a + b)


def _r_sub(r):
    n, o, b = r.choice(NAMES), r.choice(OBJECTS), r.randint(1, 5)
    a = b + r.randint(1, 5)
    return f"{n} has {a} {o} and gives away {b}. How many {o} are left?", str(a - b)


def _r_two_step(r):
    n, o, a, b = r.choice(NAMES), r.choice(OBJECTS), r.randint(2, 9), r.randint(1, 5)
    c = r.randint(1, a + b - 1)
    return (f"{n} has {a} {o}, buys {b} more, then loses {c}. How many {o} does {n} have?",
            str(a + b - c))


_CONTAINERS = ["box", "bag", "basket", "jar"]


def _r_times(r):
    a, b, o, c = r.randint(2, 5), r.randint(2, 5), r.choice(OBJECTS), r.choice(_CONTAINERS)
    return f"There are {a} {c}s with {b} {o} in each {c}. How many {o} are there in total?", str(a * b)


def _r_order(r):
    a, b, c = r.sample(NAMES, 3)
    adj, q = r.choice([("older", "oldest"), ("taller", "tallest"), ("faster", "fastest")])
    return f"{a} is {adj} than {b}. {b} is {adj} than {c}. Who is the {q}? ", a


def _r_double(r):
    (n, m), o, a = r.sample(NAMES, 2), r.choice(OBJECTS), r.randint(1, 10)
    return f"{n} has {a} {o}. {m} has double that. How many {o} does {m} have?", str(2 * a)


REASONING = {"add": _r_add, "sub": _r_sub, "two_step": _r_two_step, "times": _r_times,
             "order": _r_order, "double": _r_double}


SHOTS = 2


def reasoning(n: int, seed: int = SEED) -> list[dict]:
    items, kinds, seen = [], list(REASONING), set()
    for i in range(n):
        kind = kinds[i % len(kinds)]
        shots, (q, a) = _shots_and_question("reasoning", seed, i, kind, REASONING[kind], SHOTS, seen)
        shots = [(sq.strip(), sa) for sq, sa in shots]
        name_answer = kind == "order"
        instruction = ("Answer each question with one name." if name_answer
                       else "Answer each question with a single number.")
        items.append({"id": f"reasoning-{i:05d}", "slice": "reasoning", "cluster": f"reasoning-{i:05d}",
                      "template": f"reasoning:{kind}", "group": None,
                      "prompt": _qa_prompt(instruction, shots, q.strip()), "target": a,
                      "answer_type": "name" if name_answer else "number",
                      "candidates": [w for w in NAMES if w in q] if name_answer else None})
    return items


# ------------------------------------------------------------------ language

_NUMBER_WORDS = {
    "en": ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
           "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
           "nineteen", "twenty"],
    "fr": ["zéro", "un", "deux", "trois", "quatre", "cinq", "six", "sept", "huit", "neuf", "dix",
           "onze", "douze", "treize", "quatorze", "quinze", "seize", "dix-sept", "dix-huit", "dix-neuf",
           "vingt"],
    "de": ["null", "eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun", "zehn",
           "elf", "zwölf", "dreizehn", "vierzehn", "fünfzehn", "sechzehn", "siebzehn", "achtzehn",
           "neunzehn", "zwanzig"],
    "es": ["cero", "uno", "dos", "tres", "cuatro", "cinco", "seis", "siete", "ocho", "nueve", "diez",
           "once", "doce", "trece", "catorce", "quince", "dieciséis", "diecisiete", "dieciocho",
           "diecinueve", "veinte"],
}
_LANG_TEXT = {
    "en": {"instruction": "Answer each question with a single number.",
           "add": "What is {a} plus {b}?", "after": "What number comes after {a}?",
           "digits": "{n} wrote the number \"{w}\". Write it in digits.", "sub": "What is {a} minus {b}?"},
    "fr": {"instruction": "Réponds à chaque question par un seul nombre.",
           "add": "Combien font {a} plus {b} ?", "after": "Quel nombre vient après {a} ?",
           "digits": "{n} a écrit le nombre « {w} ». Écris-le en chiffres.",
           "sub": "Combien font {a} moins {b} ?"},
    "de": {"instruction": "Beantworte jede Frage mit einer einzigen Zahl.",
           "add": "Was ist {a} plus {b}?", "after": "Welche Zahl kommt nach {a}?",
           "digits": "{n} hat die Zahl \"{w}\" geschrieben. Schreibe sie in Ziffern.",
           "sub": "Was ist {a} minus {b}?"},
    "es": {"instruction": "Responde a cada pregunta con un solo número.",
           "add": "¿Cuánto es {a} más {b}?", "after": "¿Qué número viene después del {a}?",
           "digits": "{n} escribió el número «{w}». Escríbelo en cifras.", "sub": "¿Cuánto es {a} menos {b}?"},
}
LANGUAGES = list(_LANG_TEXT)
LANGUAGE_KINDS = ["add", "after", "digits", "sub"]


def _language_question(r, lang: str, kind: str) -> tuple[str, str]:
    t = _LANG_TEXT[lang]
    if kind == "add":
        a, b = r.randint(1, 9), r.randint(1, 9)
        return t["add"].format(a=a, b=b), str(a + b)
    if kind == "after":
        a = r.randint(1, 98)
        return t["after"].format(a=a), str(a + 1)
    if kind == "digits":
        v = r.randint(1, 20)
        return t["digits"].format(n=r.choice(NAMES), w=_NUMBER_WORDS[lang][v]), str(v)
    b = r.randint(1, 9)
    a = b + r.randint(0, 9)
    return t["sub"].format(a=a, b=b), str(a - b)


def language(n: int, seed: int = SEED) -> list[dict]:
    """Two few-shot examples fixed per (language, kind); the question is never one of them nor an
    earlier item's."""
    items, seen = [], set()
    for i in range(n):
        lang = LANGUAGES[i % len(LANGUAGES)]
        kind = LANGUAGE_KINDS[(i // len(LANGUAGES)) % len(LANGUAGE_KINDS)]
        shots, (q, a) = _shots_and_question("language", seed, i, f"{lang}:{kind}",
                                            lambda r, lang=lang, kind=kind: _language_question(r, lang, kind),
                                            2, seen)
        items.append({"id": f"language-{i:05d}", "slice": "language", "cluster": f"language-{i:05d}",
                      "template": f"language:{kind}:{lang}", "group": lang,
                      "prompt": _qa_prompt(_LANG_TEXT[lang]["instruction"], shots, q),
                      "target": a, "answer_type": "number", "kind": kind})
    return items


# ------------------------------------------------------------------ long_context

_F_SUBJECTS = ["The farmer", "A teacher", "The old man", "My neighbour", "The baker", "A child",
               "The driver", "Our friend", "The doctor", "A student"]
_F_VERBS = ["walked to", "looked at", "talked about", "cleaned", "painted", "visited", "passed",
            "remembered", "liked", "found"]
_F_OBJECTS = ["the river", "a small garden", "the market", "the library", "a quiet street",
              "the train station", "an old bridge", "the park", "a wooden house", "the school"]
_F_TAILS = ["in the morning.", "after lunch.", "on Sunday.", "with a smile.", "before the rain.",
            "for a long time.", "again and again.", "in the evening.", "without a word.", "last year."]
_KEYS = ["red box", "blue door", "green bag", "yellow car", "white cup", "black book"]


def _filler(r: random.Random, n_chars: int) -> list[str]:
    out, size = [], 0
    while size < n_chars:
        s = f"{r.choice(_F_SUBJECTS)} {r.choice(_F_VERBS)} {r.choice(_F_OBJECTS)} {r.choice(_F_TAILS)}"
        out.append(s)
        size += len(s) + 1
    return out


def long_context(n: int, seed: int = SEED, lengths: list[int] | None = None,
                 depths: list[float] | None = None) -> list[dict]:
    """One haystack (cluster) per block of len(depths) items. The haystack holds one fact per
    item, each about its own key and planted at that item's depth (plus DISTRACTORS facts about
    keys nobody asks for); each item asks about its own key. So the items of a block share the
    whole haystack (the prefix evaluator reads it once per block, not once per item) and each
    item's distractors are the other items' facts. Lengths cycle over blocks, so every length
    gets the same share."""
    lengths = list(lengths or LONG_CONTEXT_LENGTHS)
    depths = list(depths or LONG_CONTEXT_DEPTHS)
    if len(depths) + DISTRACTORS > len(_KEYS):
        raise ValueError(f"{len(depths)} depths + {DISTRACTORS} distractors need more than {len(_KEYS)} keys")
    items = []
    for block in range((n + len(depths) - 1) // len(depths)):
        length = lengths[block % len(lengths)]
        hay = _rng("long_context-haystack", seed, block * 1000 + length)
        sentences = _filler(hay, int((length - QUESTION_TOKENS) * CHARS_PER_TOKEN))
        r = _rng("long_context", seed, block)
        keys = r.sample(_KEYS, len(depths) + DISTRACTORS)
        codes = [str(c) for c in r.sample(range(1000, 10000), len(keys))]  # all different
        facts = [f"The secret number of the {k} is {c}." for k, c in zip(keys, codes)]
        # Slots in the filler: needles at their depths, distractors anywhere; inserted from the
        # back so that earlier slots keep their place.
        slots = [int(round(d * len(sentences))) for d in depths] + \
            [r.randrange(len(sentences) + 1) for _ in range(DISTRACTORS)]
        text = list(sentences)
        for slot, fact in sorted(zip(slots, facts), key=lambda x: -x[0]):
            text.insert(slot, fact)
        text = " ".join(text)
        for d, depth in enumerate(depths):
            i = block * len(depths) + d
            if i >= n:
                break
            key = keys[d]
            # The answer is cued ("...is") so the first line holds the number: asked
            # open-endedly the 135M model answered with an empty line on 12 of 12 items.
            prompt = (f"Read the text and answer the question.\n\n{text}\n\n"
                      f"Question: What is the secret number of the {key}?\n"
                      f"Answer: The secret number of the {key} is")
            items.append({"id": f"long_context-{i:05d}", "slice": "long_context",
                          "cluster": f"long_context:haystack-{block}", "group": str(length),
                          "prompt": prompt, "target": codes[d], "answer_type": "number",
                          "depth": depth, "length": length})
    return items


# ------------------------------------------------------------------ calibration (multiple choice)

_CATEGORIES = {
    "fruit": ["apple", "banana", "orange", "pear", "grape", "cherry", "lemon", "peach"],
    "animal": ["dog", "cat", "horse", "cow", "lion", "rabbit", "sheep", "tiger"],
    "color": ["red", "blue", "green", "yellow", "purple", "black", "white", "pink"],
    "vehicle": ["car", "bus", "truck", "bicycle", "train", "boat", "plane", "taxi"],
    "piece of furniture": ["chair", "table", "sofa", "bed", "desk", "shelf", "stool", "wardrobe"],
    "piece of clothing": ["shirt", "hat", "sock", "coat", "dress", "scarf", "glove", "jacket"],
}


def _mc_question(r: random.Random, kind: str) -> tuple[str, list[str], int]:
    """(question, options, index of the right option). Every kind has hundreds of distinct
    questions (category: 6 x C(8, 3) = 336 example sets; the number kinds many more), so a
    1000-item slice needs no repeat."""
    if kind == "category":
        cat = r.choice(list(_CATEGORIES))
        examples = r.sample(_CATEGORIES[cat], 4)
        right, examples = examples[0], sorted(examples[1:])
        others = [w for c, ws in _CATEGORIES.items() if c != cat for w in ws]
        options = [right] + r.sample(others, 3)
        article = "an" if cat[0] in "aeiou" else "a"
        q = f"Which of these is {article} {cat}, like {examples[0]}, {examples[1]} and {examples[2]}?"
    elif kind == "sum":
        a, b = r.randint(1, 20), r.randint(1, 20)
        right = str(a + b)
        options = [right] + [str(a + b + d) for d in r.sample([-2, -1, 1, 2, 3], 3)]
        q = f"What is {a} + {b}?"
    else:  # largest / smallest: the numbers are in the question
        options = [str(v) for v in r.sample(range(1, 100), 4)]
        right = (max if kind == "largest" else min)(options, key=int)
        options.remove(right)
        options = [right] + options
        q = None
    r.shuffle(options)
    if q is None:
        q = f"Which number is the {kind}: {', '.join(options[:-1])} or {options[-1]}?"
    return q, options, options.index(right)


def _mc_block(q: str, options: list[str]) -> str:
    # Options are not listed in the prompt: a 135M model then prefers whichever option it read
    # last (measured: 25% on 12 items, all "last option"), while plain cloze scoring does better.
    return f"Question: {q}\nAnswer:"


MC_KINDS = ["category", "largest", "smallest", "sum"]


def calibration(n: int, seed: int = SEED) -> list[dict]:
    """Cloze-style multiple choice: each option is scored by the log-likelihood of its own text as
    the answer (letter answers are at chance for a 135M model)."""
    items, seen = [], set()
    for i in range(n):
        kind = MC_KINDS[i % len(MC_KINDS)]
        shots, (q, options, label) = _shots_and_question(
            "calibration", seed, i, kind, lambda r, kind=kind: _mc_question(r, kind), 2, seen)
        prompt = "\n\n".join([f"{_mc_block(sq, so)} {so[sl]}" for sq, so, sl in shots]
                              + [_mc_block(q, options)])
        items.append({"id": f"calibration-{i:05d}", "slice": "calibration", "cluster": f"calibration-{i:05d}",
                      "template": f"calibration:{kind}", "group": None, "prompt": prompt, "choices": options,
                      "label": label, "target": options[label], "answer_type": "choice"})
    return items


# ------------------------------------------------------------------ tool_args

CITIES = ["Paris", "Berlin", "Madrid", "Rome", "London", "Tokyo", "Oslo", "Lima", "Vienna", "Dublin",
          "Lisbon", "Prague", "Warsaw", "Athens", "Cairo", "Delhi", "Seoul", "Sydney", "Toronto",
          "Chicago", "Boston", "Denver", "Miami", "Nairobi", "Bangkok", "Manila", "Moscow", "Zurich",
          "Helsinki", "Stockholm", "Budapest", "Santiago"]
CONTACTS = ["Alice", "Bob", "Carol", "David", "Eve", "Frank", "Grace", "Henry", "Irene", "Jack",
            "Kate", "Liam"]
CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CHF", "CAD"]
TOOLS = {
    "get_weather": {"name": "get_weather", "parameters": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]},
    "set_alarm": {"name": "set_alarm", "parameters": {
        "hour": {"type": "integer"}, "minute": {"type": "integer"}}, "required": ["hour", "minute"]},
    "send_message": {"name": "send_message", "parameters": {
        "to": {"type": "string"}, "text": {"type": "string"}}, "required": ["to", "text"]},
    "convert_currency": {"name": "convert_currency", "parameters": {
        "amount": {"type": "integer"}, "source": {"type": "string", "enum": CURRENCIES},
        "target": {"type": "string", "enum": CURRENCIES}}, "required": ["amount", "source", "target"]},
}
_MESSAGES = ["hello", "see you soon", "thank you", "good night", "call me", "I am on my way",
             "happy birthday", "running late", "see you at noon", "good luck", "where are you",
             "dinner is ready", "the meeting moved", "drive safely", "welcome home"]
_AMOUNTS = [5, 10, 15, 20, 25, 30, 40, 50, 60, 75, 80, 100, 120, 150, 200, 250, 300, 500]


def _tool_request(r: random.Random, tool: str) -> tuple[str, dict]:
    """A request and the arguments it asks for. Each tool has 300+ distinct requests, so a
    1000-item slice (250 per tool) needs no repeat."""
    if tool == "get_weather":
        city, unit = r.choice(CITIES), r.choice(["celsius", "fahrenheit"])
        return r.choice([f"What is the weather in {city} in {unit}?",
                         f"Tell me the weather in {city}, in {unit}.",
                         f"How is the weather in {city}? Answer in {unit}.",
                         f"Weather for {city} please, in {unit}.",
                         f"I need the {city} weather in {unit}.",
                         f"Is it warm in {city}? Give me the weather in {unit}."]), {"city": city, "unit": unit}
    if tool == "set_alarm":
        h, m = r.randint(1, 12), r.choice(range(0, 60, 5))
        return r.choice([f"Set an alarm for {h}:{m:02d}.", f"Wake me up at {h}:{m:02d}.",
                         f"Please set my alarm to {h}:{m:02d}."]), {"hour": h, "minute": m}
    if tool == "send_message":
        to, text = r.choice(CONTACTS), r.choice(_MESSAGES)
        return r.choice([f"Send the message \"{text}\" to {to}.",
                         f"Tell {to} \"{text}\" by message."]), {"to": to, "text": text}
    amount = r.choice(_AMOUNTS)
    src, dst = r.sample(CURRENCIES, 2)
    return f"Convert {amount} {src} to {dst}.", {"amount": amount, "source": src, "target": dst}


def _call(name: str, args: dict) -> str:
    return json.dumps({"name": name, "arguments": args})


def tool_args(n: int, seed: int = SEED) -> list[dict]:
    items, names, seen = [], list(TOOLS), set()
    for i in range(n):
        tool = names[i % len(names)]
        shot_tool = names[(i + 1) % len(names)]  # the example shows another tool's call
        shot_req, shot_args = _tool_request(_rng("tool_args-shots", seed, names.index(tool)), shot_tool)
        _, (req, args) = _shots_and_question("tool_args", seed, i, tool,
                                             lambda r, tool=tool: _tool_request(r, tool), 0, seen)
        prompt = ("Reply with a JSON function call only, in the form "
                  "{\"name\": ..., \"arguments\": {...}}.\n\n"
                  f"Function: {json.dumps(TOOLS[shot_tool])}\nRequest: {shot_req}\n"
                  f"Call: {_call(shot_tool, shot_args)}\n\n"
                  f"Function: {json.dumps(TOOLS[tool])}\nRequest: {req}\nCall:")
        items.append({"id": f"tool_args-{i:05d}", "slice": "tool_args", "cluster": f"tool_args-{i:05d}",
                      "template": f"tool_args:{tool}", "group": None, "prompt": prompt,
                      "target": _call(tool, args), "answer_type": "json_call", "tool": TOOLS[tool],
                      "expected": {"name": tool, "arguments": args}})
    return items


# ------------------------------------------------------------------ registry and I/O

GENERATORS = {"reasoning": reasoning, "language": language, "long_context": long_context,
              "calibration": calibration, "tool_args": tool_args}


def generate(slice_name: str, n: int, seed: int = SEED, **params) -> list[dict]:
    if slice_name not in GENERATORS:
        raise KeyError(f"unknown slice '{slice_name}' (known: {', '.join(GENERATORS)})")
    return GENERATORS[slice_name](n, seed, **params)


def to_jsonl(items: list[dict]) -> bytes:
    return "".join(json.dumps(it, ensure_ascii=False, sort_keys=True) + "\n" for it in items).encode()


def shipped_bytes(slice_name: str) -> bytes:
    """What evals/data/<slice>.jsonl must contain, byte for byte."""
    return to_jsonl(generate(slice_name, SHIPPED[slice_name]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="compare instead of writing")
    args = p.parse_args(argv)
    bad = 0
    for name in GENERATORS:
        path, data = DATA / f"{name}.jsonl", shipped_bytes(name)
        if args.check:
            if not path.is_file() or path.read_bytes() != data:
                print(f"{path}: differs from a fresh generation", file=sys.stderr)
                bad += 1
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            print(f"{path}: {SHIPPED[name]} items, {len(data)} bytes")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
