"""Build the instruction-style prompt set the draft is distilled on: data/distill/prompts.jsonl.

    python tools/distill_prompts.py [--out data/distill/prompts.jsonl] [--check]

The prompts are made programmatically (task templates x topics, plus
arithmetic word problems, code requests and text-rewriting tasks with
generated inputs) from a fixed seed, so the file is the same on every run;
`--check` verifies that the committed file matches what this script builds.

Each line is {"id": int, "split": "train" | "heldout", "kind": str,
"messages": [{"role": "user", "content": str}, ...]}. The held-out split
(about 3%, chosen by a seeded shuffle) is never generated from nor trained
on: tools/distill_draft.py measures acceptance on it. Kind "freeform" is a
small hand-written set in a different style from the templates, all held out,
so the measurement also covers prompts the templates never produce.

Ids are stable: new prompts must be appended with new ids, never inserted,
because the generated shards in data/distill/ refer to prompts by id.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

SEED = 20261130
HELDOUT_FRACTION = 0.03

TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "plate tectonics", "volcanoes", "earthquakes", "climate change",
    "renewable energy", "solar panels", "wind turbines", "electric cars", "batteries", "the immune system", "vaccines",
    "sleep", "nutrition", "vitamins", "exercise", "meditation", "stress", "the human heart", "the brain", "DNA",
    "evolution", "dinosaurs", "honeybees", "coral reefs", "rainforests", "deserts", "the ocean tides", "the moon",
    "the solar system", "Mars exploration", "telescopes", "gravity", "magnetism", "electricity", "light and color",
    "sound waves", "the speed of light", "atoms", "chemical reactions", "the periodic table", "acids and bases",
    "the Roman Empire", "ancient Egypt", "the Renaissance", "the Industrial Revolution", "the printing press",
    "World War I", "the Cold War", "the French Revolution", "the Silk Road", "the Great Wall of China",
    "democracy", "taxes", "inflation", "interest rates", "saving money", "budgeting", "credit scores",
    "the stock market", "cryptocurrency", "small businesses", "marketing", "job interviews", "writing a resume",
    "public speaking", "time management", "teamwork", "leadership", "negotiation", "learning a new language",
    "studying for exams", "online learning", "reading habits", "writing a novel", "poetry", "painting", "photography",
    "playing the guitar", "learning the piano", "classical music", "jazz", "film making", "video games", "chess",
    "football", "basketball", "running a marathon", "swimming", "yoga", "hiking", "camping", "gardening",
    "growing tomatoes", "composting", "houseplants", "keeping a dog", "cats", "birdwatching", "baking bread",
    "making pasta", "cooking rice", "coffee", "tea", "chocolate", "healthy breakfasts", "vegetarian cooking",
    "food safety", "travelling on a budget", "visiting Japan", "visiting Paris", "packing for a trip",
    "public transport", "city planning", "recycling", "plastic pollution", "air quality", "clean water",
    "the internet", "how search engines work", "cloud computing", "computer viruses", "passwords", "encryption",
    "artificial intelligence", "machine learning", "robots", "smartphones", "social media", "email etiquette",
    "open source software", "databases", "the Python language", "version control with git", "web browsers",
    "spreadsheets", "3D printing", "drones", "self-driving cars", "space stations", "satellites", "weather forecasts",
    "rainbows", "snowflakes", "lightning", "hurricanes", "friendship", "kindness", "happiness", "habits",
    "minimalism", "volunteering", "parenting", "moving to a new city", "first day at a new job", "remote work",
]

AUDIENCES = ["a five-year-old", "a high school student", "a beginner", "a busy professional", "my grandmother",
             "a curious teenager", "someone who has never heard of it"]

TEMPLATES = [
    "Explain {topic} in simple terms.",
    "Explain {topic} to {audience}.",
    "What is {topic}?",
    "Why is {topic} important?",
    "Give me three interesting facts about {topic}.",
    "List five key points about {topic}.",
    "Write a short paragraph about {topic}.",
    "Write a short poem about {topic}.",
    "Write a haiku about {topic}.",
    "Write a short story that involves {topic}.",
    "What are the pros and cons of {topic}?",
    "What are common misconceptions about {topic}?",
    "Give me some tips about {topic}.",
    "How can I learn more about {topic}?",
    "Summarize the main ideas of {topic} in two sentences.",
    "Write a tweet about {topic}.",
    "Write a blog post introduction about {topic}.",
    "Create a quiz with three questions about {topic}.",
    "What questions should I ask an expert on {topic}?",
    "Compare {topic} and {other}.",
    "How are {topic} and {other} related?",
    "Write a short dialogue between two friends talking about {topic}.",
    "Describe {topic} using an analogy.",
    "What is the history of {topic}?",
    "What might the future of {topic} look like?",
    "Write an email to a colleague about {topic}.",
    "Give a step-by-step guide related to {topic}.",
    "I am confused about {topic}. Can you help?",
    "Can you tell me something surprising about {topic}?",
    "Write a motivational message that mentions {topic}.",
    "Outline a lesson plan about {topic}.",
    "What are the benefits of {topic}?",
    "What are the risks or downsides of {topic}?",
    "Define {topic} in one sentence, then give an example.",
    "Write a product description inspired by {topic}.",
    "Write a limerick about {topic}.",
    "Tell me a fun fact about {topic}.",
    "How would you explain {topic} in an interview?",
    "What vocabulary words are useful when talking about {topic}?",
    "Write the opening lines of a speech about {topic}.",
]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "returns the nth Fibonacci number",
    "counts the vowels in a string", "finds the largest element of a list", "removes duplicates from a list",
    "sorts a list of dictionaries by a key", "checks whether a string is a palindrome", "merges two sorted lists",
    "converts Celsius to Fahrenheit", "computes the average of a list of numbers", "counts word frequencies in a text",
    "flattens a nested list", "finds the greatest common divisor of two numbers", "reads a file and counts its lines",
    "checks whether two strings are anagrams", "returns the second largest number in a list",
    "capitalizes the first letter of every word", "computes the sum of the digits of a number",
    "finds all even numbers in a list", "implements binary search", "transposes a matrix",
    "validates an email address with a simple check", "converts a number to binary",
]
LANGUAGES = ["Python", "Python", "Python", "JavaScript", "C", "Java", "Rust", "Go"]
CODE_TEMPLATES = [
    "Write a {lang} function that {task}.",
    "How do I write a {lang} program that {task}?",
    "Show me {lang} code that {task}, and explain it.",
    "Write a short {lang} snippet that {task}.",
]

NAMES = ["Alice", "Bob", "Maria", "Ahmed", "Li", "Sofia", "Tom", "Priya", "Lucas", "Emma", "Kenji", "Fatima"]
ITEMS = ["apples", "books", "pencils", "stickers", "cookies", "marbles", "oranges", "cards", "coins", "flowers"]
MATH_TEMPLATES = [
    "{a} has {x} {item}. {b} gives {a} {y} more. How many {item} does {a} have now?",
    "{a} had {x} {item} and gave {y} to {b}. How many {item} are left?",
    "A box holds {x} {item}. How many {item} are in {y} boxes?",
    "{a} shares {z} {item} equally among {y} friends. How many does each friend get?",
    "What is {x} plus {y}?", "What is {x} times {y}?", "What is {z} divided by {y}?", "What is {x} minus {y}?",
    "If a train travels at {x} km per hour for {y} hours, how far does it go?",
    "A shirt costs {x} dollars and is discounted by {p} percent. What is the new price?",
    "Solve for x: {y}x + {x} = {w}.",
    "What is {p} percent of {z}?",
]

REWRITE_TASKS = ["Rewrite this sentence to be more formal", "Fix the grammar in this sentence",
                 "Translate this sentence into French", "Translate this sentence into Spanish",
                 "Make this sentence shorter", "Rewrite this sentence in the passive voice",
                 "Classify the sentiment of this sentence as positive, negative or neutral",
                 "Turn this sentence into a question", "Explain what this sentence means"]
SENTENCES = [
    "me and him goes to the store yesterday", "The cat sat on the warm windowsill all afternoon.",
    "I can't believe how good this pizza is!", "The meeting has been moved to Thursday morning.",
    "She don't like when people is late.", "This phone stopped working after two days, very disappointing.",
    "The children played in the park until the sun went down.", "We should of left earlier to avoid the traffic.",
    "Our team finished the project ahead of schedule.", "The weather today is cloudy with a chance of rain.",
    "He has been learning to play the violin for three years.", "the results was better then we expected",
    "Please send me the report by the end of the day.", "The museum is closed on Mondays.",
    "I think that movie was boring and too long.", "They planted a tree in the garden last spring.",
]

# hand-written, all held out: a different register from the templates above
FREEFORM = [
    "hey whats a good name for a goldfish",
    "My sourdough starter smells like nail polish remover. Is it dead?",
    "Can you help me plan a birthday party for ten kids?",
    "What should I cook tonight if I only have eggs, spinach and cheese?",
    "Is it better to rent or buy a house? Give a balanced answer.",
    "Write a thank-you note to my neighbour who watered my plants.",
    "I keep procrastinating. Any practical advice?",
    "Tell me a joke about computers.",
    "How many legs does a spider have, and why?",
    "Describe a sunset without using the word 'sun'.",
    "What's the difference between weather and climate?",
    "Give me a weekly workout plan for a beginner.",
    "Why do cats purr?",
    "Write a two-sentence horror story.",
    "What are some good questions to ask on a first date?",
    "How do airplanes stay in the air?",
    "Suggest three names for a bakery and explain each.",
    "What does a software engineer do all day?",
    "Explain the rules of tic-tac-toe.",
    "Write a short bedtime story about a brave little turtle.",
    "How can I make my small apartment feel bigger?",
    "Is coffee bad for you?",
    "Summarize the plot of Romeo and Juliet.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Help me write a polite message declining a wedding invitation.",
    "What are the planets in our solar system, in order?",
    "How do I change a flat tire?",
    "Write a recipe for a simple tomato soup.",
    "Why is the sea salty?",
    "Give me a riddle and its answer.",
    "Explain what a mortgage is.",
    "I have a job interview tomorrow for a cashier position. How should I prepare?",
]


def _math_prompt(rng: random.Random) -> str:
    y = rng.randint(2, 12)
    x = rng.randint(2, 60)
    return rng.choice(MATH_TEMPLATES).format(
        a=rng.choice(NAMES), b=rng.choice(NAMES), item=rng.choice(ITEMS), x=x, y=y, z=y * rng.randint(2, 15),
        w=y * rng.randint(1, 20) + x, p=rng.choice([5, 10, 15, 20, 25, 30, 40, 50]))


def build_prompts(seed: int = SEED) -> list[dict]:
    """All prompts, deterministic in `seed`: list of {"id", "split", "kind", "messages"}."""
    rng = random.Random(seed)
    items: list[tuple[str, str]] = []  # (kind, user text)
    for topic in TOPICS:
        for tpl in TEMPLATES:
            items.append(("topic", tpl.format(topic=topic, audience=rng.choice(AUDIENCES),
                                              other=rng.choice([t for t in TOPICS if t != topic]))))
    for task in CODE_TASKS:
        for tpl in CODE_TEMPLATES:
            items.append(("code", tpl.format(lang=rng.choice(LANGUAGES), task=task)))
    for _ in range(800):
        items.append(("math", _math_prompt(rng)))
    for task in REWRITE_TASKS:
        for s in SENTENCES:
            items.append(("rewrite", f"{task}: \"{s}\""))
    rng.shuffle(items)  # generation walks the file in order, so every prefix is a mix of kinds
    items = list(dict.fromkeys(items))  # exact duplicates (math can repeat) are kept once
    n_held = int(len(items) * HELDOUT_FRACTION)
    held = set(rng.sample(range(len(items)), n_held))
    out = [{"id": i, "split": "heldout" if i in held else "train", "kind": kind,
            "messages": [{"role": "user", "content": text}]} for i, (kind, text) in enumerate(items)]
    for text in FREEFORM:
        out.append({"id": len(out), "split": "heldout", "kind": "freeform",
                    "messages": [{"role": "user", "content": text}]})
    return out


def to_jsonl(prompts: list[dict]) -> str:
    return "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in prompts)


def load_prompts(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no prompt file at {path}; build it with: "
                                f"python tools/distill_prompts.py --out {path}")
    prompts = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for i, p in enumerate(prompts):
        if p.get("id") != i:
            raise ValueError(f"{path}: line {i + 1} has id {p.get('id')!r}; ids must be 0, 1, 2, ... in order")
    return prompts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="data/distill/prompts.jsonl")
    ap.add_argument("--check", action="store_true", help="verify that --out matches what this script builds")
    args = ap.parse_args(argv)
    text = to_jsonl(build_prompts())
    out = Path(args.out)
    if args.check:
        if not out.is_file() or out.read_text() != text:
            print(f"{out} differs from what tools/distill_prompts.py builds", file=sys.stderr)
            return 1
        print(f"{out} is up to date")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    n = text.count("\n")
    print(f"wrote {n} prompts to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
