"""The built-in prompt set for acceptance measurement, grouped by kind (the acceptance slices).

Acceptance depends on what is being generated: code and structured output repeat their context
(n-gram lookup thrives), chat is freer, long-context prompts make the draft read far tokens. Until
the quality slices feed their own prompts, these are the slices. Written for this project.
"""
from __future__ import annotations

from pipeline.core.stage import StageError, progress

KINDS = ("chat", "code", "long_context", "structured")

_REPORT = (
    "Quarterly operations summary. The Lisbon warehouse shipped 4,210 orders in March, up from 3,870 "
    "in February. Average packing time fell to 6.2 minutes after the new conveyor was installed on "
    "March 9. Two incidents were logged: a forklift battery failure on March 14 (no injuries) and a "
    "mislabelled pallet of ceramic tiles on March 22, which was returned to the supplier, Azulejos "
    "Norte. The night shift, led by Marta Ferreira, handled 38% of all orders. Customer complaints "
    "dropped from 57 to 41; most remaining complaints concern delivery windows in the Algarve region. "
    "The team proposes hiring two more drivers for the southern routes and moving the weekly "
    "inventory count from Friday to Monday morning, when the loading bays are quiet. "
)
_STORY = (
    "The lighthouse keeper, Ansel, kept three logbooks. The blue one recorded the weather every "
    "four hours; the red one listed every ship that passed, with its flag and heading; the green "
    "one, which he showed no one, held the names of the birds that rested on the gallery rail. In "
    "the winter of the great storm the red book filled up first, because forty-one fishing boats "
    "sheltered in the bay for nine days. On the tenth day the storm broke, the boats left in a "
    "single line, and Ansel wrote in the green book that a grey heron had stood on the rail all "
    "morning, facing the sea, as if counting them out. "
)

PROMPTS: dict[str, list[str]] = {
    "chat": [
        "What are three simple ways to save energy at home?",
        "Explain in two sentences why the sky is blue.",
        "I have a job interview tomorrow. Can you give me some advice?",
        "Write a short, friendly message inviting a neighbour to dinner.",
        "What is the difference between weather and climate?",
        "Suggest a name for a small bakery and explain your choice.",
        "How do I keep a basil plant alive indoors?",
        "Summarize the plot of a heist movie in three sentences.",
    ],
    "code": [
        "Write a Python function `is_palindrome(s)` that ignores case and spaces.",
        "Write a Python function that returns the n-th Fibonacci number iteratively.",
        "Write a JavaScript function that removes duplicate values from an array.",
        "Write a Python class `Stack` with push, pop and peek methods.",
        "Write a SQL query that returns the five customers with the highest total order value "
        "from tables customers(id, name) and orders(id, customer_id, amount).",
        "Write a Python function that counts how often each word occurs in a text.",
        "Write a bash one-liner that counts the lines of every .py file in a directory.",
        "Write a Python function `merge_sorted(a, b)` that merges two sorted lists.",
    ],
    "long_context": [
        _REPORT + "\n\nQuestion: How many orders did the Lisbon warehouse ship in March, and who led "
        "the night shift?",
        _STORY + "\n\nQuestion: What did each of Ansel's three logbooks record?",
        _REPORT + _STORY + "\n\nQuestion: On which date was the conveyor installed?",
        _STORY + _REPORT + "\n\nQuestion: How many fishing boats sheltered in the bay, and for how long?",
        _REPORT + "\n\nRewrite the summary above as a bulleted list of the key numbers.",
        _STORY + "\n\nRetell the story above in three sentences.",
    ],
    "structured": [
        "Return a JSON object with keys name, age and city for a fictional person. Output only JSON.",
        "Call the weather tool for Paris in celsius. Reply with a JSON object "
        "{\"name\": ..., \"arguments\": {...}} and nothing else.",
        "List three fruits as a JSON array of objects with keys \"fruit\" and \"colour\".",
        "Write a YAML config with a server section (host, port) and a database section (url, pool_size).",
        "Produce a CSV table with header id,product,price and three rows of example data.",
        "Call the tool `search_flights` with origin LIS, destination BER and date 2024-05-01. Answer "
        "with the JSON call only.",
        "Convert this to JSON: name Ana, languages Portuguese and English, employed yes.",
        "Return a JSON list of the first five prime numbers under the key \"primes\".",
    ],
}


def prompt_ids(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as a user turn, through the tokenizer's chat template when it has one."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in some versions
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer.encode(text)


def prompts_by_kind(per_kind: int) -> dict[str, list[tuple[str, str]]]:
    """kind -> [(prompt id, text)], the first `per_kind` of each kind."""
    out = {}
    for kind in KINDS:
        texts = PROMPTS[kind][:per_kind]
        out[kind] = [(f"{kind}-{i}", t) for i, t in enumerate(texts)]
    return out


def acceptance_prompts(per_kind: int, tokenizer, stage: str) -> dict[str, list[tuple[str, list[int]]]]:
    """kind -> [(prompt id, token ids)], the acceptance slices' prompts (the latency stage times
    speculative rounds on the same ones). A kind with fewer built-in prompts than asked uses all
    it has and says so on stderr; the artifacts record the prompt ids actually used."""
    by_kind = prompts_by_kind(per_kind)
    short = {kind: len(rows) for kind, rows in by_kind.items() if len(rows) < per_kind}
    if short:
        progress(f"{stage}: acceptance.prompts_per_kind = {per_kind}, but the built-in set has only "
                 + ", ".join(f"{n} {kind}" for kind, n in short.items()) + " prompts: using those "
                 "(the JSON lists the prompts used under 'prompts')")
    prompts = {kind: [(pid, prompt_ids(tokenizer, text)) for pid, text in rows] for kind, rows in by_kind.items()}
    if not any(prompts.values()):
        raise StageError(f"{stage}: acceptance.prompts_per_kind must be >= 1 (no prompts to measure)")
    return prompts
