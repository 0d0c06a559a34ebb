"""Chat prompts for decoding benchmarks, as token ids through the tokenizer's chat template.

A fixed set of 8 prompts (PROMPTS: questions, summaries of a given paragraph, and edits of given code,
where answers quote their input, which is where prompt lookup helps), the paragraphs for longer prompts,
and one short question per topic for many sessions at once. `chat_ids` is how every benchmark turns
messages into a prompt: the chat template's text, then its tokens without special tokens added again.
"""

from __future__ import annotations

LIGHTHOUSE = (
    "For more than two centuries the lighthouse on Gull Point warned ships away from the reef that runs "
    "north of the harbour. Its first lamp burned whale oil and had to be trimmed every few hours by a "
    "keeper who lived in the small stone cottage at its base. In 1890 the oil lamp was replaced by a "
    "kerosene burner and a large glass lens that could be seen twenty miles out to sea. The last keeper "
    "left in 1962, when the light was automated, and today the tower is a museum run by volunteers who "
    "restored the lens and repainted the red and white bands that sailors once used to recognise it."
)
SOURDOUGH = (
    "Sourdough bread rises without commercial yeast. Instead, bakers keep a starter: a mixture of flour and "
    "water in which wild yeasts and lactic acid bacteria live together. Each day part of the starter is "
    "thrown away and the rest is fed with fresh flour and water, which keeps the microbes active. When "
    "the dough is mixed, a portion of the starter is added, and the long, slow fermentation that follows "
    "gives the bread its sour taste, its open crumb and a crust that stays crisp for days. Because the "
    "process takes time, many bakers start their dough the evening before they bake."
)
COUNCIL = (
    "On Tuesday the city council voted to close Market Street to cars on Saturdays from May to September. "
    "Shop owners had asked for the change after a trial last summer, when the street was filled with "
    "stalls, musicians and families, and sales in the shops rose by almost a fifth. Some residents "
    "worried about parking and deliveries, so the council will open a temporary car park behind the "
    "station and allow deliveries before nine in the morning. The first car-free Saturday is planned for "
    "the second weekend of May, and the council will review the scheme at the end of the season."
)
MEAN_CODE = """def mean(values):
    total = 0
    count = 0
    for value in values:
        total = total + value
        count = count + 1
    if count == 0:
        return 0
    return total / count
"""
GREET_CODE = """def greet(name, times):
    lines = []
    for i in range(times):
        lines.append("Hello, " + name + "!")
    return "\\n".join(lines)
"""

PROMPTS: list[tuple[str, str]] = [  # (category, user message)
    ("chat", "What causes the seasons on Earth? Explain briefly."),
    ("chat", "Give me three tips for learning a new language."),
    ("chat", "What is the difference between a virus and a bacterium?"),
    ("summarise", f"Summarise this paragraph in two sentences:\n\n{LIGHTHOUSE}"),
    ("summarise", f"Summarise this paragraph in two sentences:\n\n{SOURDOUGH}"),
    ("summarise", f"Summarise this paragraph in two sentences:\n\n{COUNCIL}"),
    (
        "edit",
        "Rename the variable `total` to `running_sum` in this Python function and show the whole "
        f"function:\n\n```python\n{MEAN_CODE}```",
    ),
    (
        "edit",
        f"Add type hints to this Python function and show the whole function:\n\n```python\n{GREET_CODE}```",
    ),
]

TOPICS = ["the sea", "a mountain", "a city at night", "an old library", "a robot", "the moon", "a garden",
          "a train journey", "winter", "a lighthouse", "a market", "the desert", "a violin", "a storm",
          "a friendship", "a forest"]  # fmt: skip


def chat_ids(tokenizer, messages: str | list[dict], add_generation_prompt: bool = True) -> list[int]:
    """A user message (or a whole conversation) as the token ids of the tokenizer's chat template."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return tokenizer(text, add_special_tokens=False).input_ids


def topic_question(index: int) -> str:
    """The `index`th session's question: one per topic, each round over them one dot longer (all differ)."""
    return f"Write a few sentences about {TOPICS[index % len(TOPICS)]}" + "." * (1 + index // len(TOPICS))


def topic_prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` different chat prompts, one a session."""
    return [chat_ids(tokenizer, topic_question(i)) for i in range(count)]


def benchmark_prompts(tokenizer) -> list[tuple[str, list[int]]]:
    """PROMPTS as (category, chat prompt ids)."""
    return [(kind, chat_ids(tokenizer, text)) for kind, text in PROMPTS]
