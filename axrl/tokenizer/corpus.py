"""Deterministic synthetic training corpus for the BPE tokenizer.

Nothing is downloaded: text is generated from small word lists with a seeded RNG, shaped like
what AxRL's tasks feed the model (chat turns, arithmetic, calculator tool calls), so those
strings tokenize compactly. The text is what appears *between* special tokens in rendered
chats; the special tokens themselves are never part of BPE training.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

_SUBJECTS = """the model|a student|my friend|the teacher|this agent|the robot|our team|the user|
a farmer|the old man|she|he|they|we|the assistant|every child|the cat|a small dog|the system|
the scientist|the writer|the engineer|a bird|the policy|the reviewer|the city|my sister""".replace("\n", "").split("|")
_VERBS = """reads|writes|finds|checks|counts|builds|sees|likes|needs|wants|knows|makes|takes|gives|
learns|solves|answers|computes|tries|uses|opens|closes|moves|keeps|calls|returns|explains|
shows|follows|helps|trains|tests|visits|remembers|chooses|carries|paints|watches|plays""".replace("\n", "").split("|")
_OBJECTS = """a book|the problem|the answer|some water|a new idea|the number|the result|a letter|
the question|the river|a long story|the map|the door|a small box|the garden|the data|
the function|the tool|a simple task|the window|the road|the program|the lesson|a good reason|
the world|the market|a quiet room|the light|the table|the music|the weather|the train""".replace("\n", "").split("|")
_ADVERBS = """quickly|slowly|carefully|today|again|every day|at night|in the morning|with care|
without help|before dinner|after school|right now|once more|step by step|together|alone|
in the end|at first|by hand|for fun|on time|very well|in silence""".replace("\n", "").split("|")
# Frequent English words, for free-form filler text beyond the fixed sentence frame.
_COMMON = """time year people way day thing world life hand part child eye woman place work week
case point government company number group problem fact water money month lot right study book
word business issue side kind head house service friend father power hour game line end member
law car city community name president team minute idea kid body information back parent face
others level office door health person art war history party result change morning reason
research girl guy moment air teacher force education first last long great little own other old
big high different small large next early young important few public bad same able good new
about after again against always because before between during every never often only should
think through under until where which while would could people know take see come want look use
find give tell call try ask need feel become leave put mean keep let begin seem help show hear
play run move live believe bring happen write provide sit stand lose pay meet include continue
set learn lead understand watch follow stop create speak read allow add spend grow open walk win
offer remember love consider appear buy wait serve die send expect build stay fall cut reach kill
remain suggest raise pass sell require report decide pull explain develop carry break receive
agree support hit produce eat cover catch draw choose simple example function value string list
error output input step first second third because therefore however finally""".split()
_NAMES = ["Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Iris", "Jack",
          "Kate", "Liam", "Mia", "Noah", "Olivia", "Paul", "Quinn", "Rosa", "Sam", "Tara"]
_CONNECTORS = ["and", "but", "because", "so", "while", "although", "then", "when", "if", "after"]
_CHAT_OPENERS = [
    "Hello! How can I help you today?", "Sure, let me think about that.", "Thanks for asking.",
    "I am not sure, but here is my best guess.", "Let me check with the calculator.",
    "Good question.", "Here is a short explanation.", "Can you tell me more?",
    "That is correct.", "That is not right. Let us try again.", "Please solve the problem.",
    "You are a helpful assistant.", "You are a careful math tutor. Think step by step.",
    "Use the calculator tool when you need to do arithmetic.",
]
_OPS = [("+", "plus", lambda a, b: a + b), ("-", "minus", lambda a, b: a - b),
        ("*", "times", lambda a, b: a * b)]

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression and return the result.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 37 + 58"}},
            "required": ["expression"],
        },
    },
}

# Text of the template's tools preamble, so the system prompt of tool tasks is cheap to encode.
_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(CALCULATOR_TOOL, ensure_ascii=False)
    + "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within "
)


def _sentence(rng: random.Random) -> str:
    s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    if rng.random() < 0.5:
        s += f" {rng.choice(_ADVERBS)}"
    if rng.random() < 0.3:
        s += f" {rng.choice(_CONNECTORS)} {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    return s[0].upper() + s[1:] + rng.choice([".", ".", ".", "!", "?"])


def _filler(rng: random.Random) -> str:
    words = [rng.choice(_COMMON) for _ in range(rng.randint(4, 14))]
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), rng.choice(_NAMES))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice([".", ",", ".", "?", "!", ";", ":"])


def _arith(rng: random.Random) -> tuple[str, str, int]:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    op, word, fn = rng.choice(_OPS)
    return f"{a} {op} {b}", f"{a} {word} {b}", fn(a, b)


def _sample(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.2:
        return " ".join(_sentence(rng) for _ in range(rng.randint(1, 4)))
    if kind < 0.35:
        return " ".join(_filler(rng) for _ in range(rng.randint(1, 3)))
    expr, words, value = _arith(rng)
    if kind < 0.6:
        q = rng.choice([f"What is {expr}?", f"Compute {expr}.", f"What is {words}?",
                        f"Calculate {expr} and give the answer."])
        a = rng.choice([f"The answer is {value}.", f"{expr} = {value}", f"{value}",
                        f"Let me compute {expr}. The answer is {value}."])
        return f"user\n{q}\nassistant\n{a}"
    if kind < 0.85:
        call = {"name": "calculator", "arguments": {"expression": expr}}
        return rng.choice([
            json.dumps(call, ensure_ascii=False),
            f"assistant\nLet me use the calculator.\n\n{json.dumps(call, ensure_ascii=False)}\n",
            f"\n{json.dumps({'result': value})}\n",
            f"\n{value}\n",
            "\nerror: invalid expression\n",
        ])
    if kind < 0.95:
        return f"{rng.choice(_CHAT_OPENERS)} {_sentence(rng)}"
    return f"system\n{rng.choice(_CHAT_OPENERS)}\n\n{_TOOLS_PREAMBLE}"


def generate(n: int = 20000, seed: int = 0) -> Iterator[str]:
    """Yield ``n`` synthetic training strings; same ``(n, seed)`` gives the same strings."""
    rng = random.Random(seed)
    for _ in range(n):
        yield _sample(rng)
