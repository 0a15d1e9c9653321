"""The prompt set for self-distillation: templates and hand-written seeds, expanded with a fixed
seed into thousands of varied prompts (code, prose, lists, Q&A, dialogue, math, chat turns and
raw-text continuations). Held-out prompts use topics, names and numbers the training prompts never
see (every 8th topic/subject of each pool is held out), plus hand-written held-out seeds.

`build(seed)` returns (train, heldout): lists of dicts {"kind", "chat", "text"}; `text` is the
exact string tokenized (chat prompts already wrapped in Gemma's turn markers).
"""
import random

TOPICS = """photosynthesis; the French Revolution; black holes; machine learning; the water cycle; compound interest;
the immune system; plate tectonics; the printing press; climate change; quantum computing; the Roman Empire;
electric cars; the human heart; volcanoes; the stock market; DNA replication; the Industrial Revolution;
renewable energy; the Moon landing; vaccines; coral reefs; the internet; inflation; honeybees; the Silk Road;
nuclear fusion; the Renaissance; antibiotics; rainforests; blockchain; the Great Wall of China; sleep; gravity;
the Olympic Games; recycling; jazz music; ancient Egypt; earthquakes; social media; the solar system; coffee;
democracy; hurricanes; the periodic table; chess; the Cold War; bread baking; electricity; meditation;
the Amazon river; cryptography; dinosaurs; the theory of evolution; tea ceremonies; public libraries;
self-driving cars; the Mona Lisa; glaciers; the Byzantine Empire; wind turbines; supply chains; octopuses;
the human brain; origami; the Apollo program; microplastics; volunteering; the Beatles; desert ecosystems;
3D printing; the Ottoman Empire; urban gardening; the speed of light; marathon training; typography;
the Great Depression; tides; operating systems; penguins; the Magna Carta; solar panels; language learning;
the Hubble telescope; minimalism; the Mayan civilization; batteries; sourdough; lighthouses; the Vikings;
cloud computing; rainbows; the Eiffel Tower; friendship; chocolate; time management; the printing of money;
bicycles; the ozone layer; public speaking; the Pacific Ocean; pandemics; Shakespeare; robotics; mushrooms;
the metric system; board games; ancient Greece; satellites; composting; the violin; video games; elephants;
the Suez Canal; budgeting; the Northern Lights; nutrition; architecture; the Bronze Age; wolves; podcasts;
the human skeleton; weather forecasting; haiku poetry; the Titanic; open source software; mountains;
photography; the Declaration of Independence; sharks; remote work; the Sahara; comets; yoga; the abacus;
submarines; fairy tales; the immune response to allergies; tsunamis; hydroponics; the Aztecs; bridges;
the ancient Olympics; cheese making; caves; railways; the Industrial use of steam; volcanic islands;
migration of birds; card games; trade winds; the history of mathematics; lullabies; the Arctic; calligraphy""".replace("\n", " ")
TOPICS = [t.strip() for t in TOPICS.split(";") if t.strip()]

AUDIENCES = ["a five-year-old", "a high school student", "a busy executive", "a beginner", "an expert", "my grandmother",
             "a software engineer", "a tourist", "a new employee", "a curious teenager"]
LANGS = ["Python", "JavaScript", "Rust", "C", "Go", "Java", "TypeScript", "C++", "Bash", "Ruby"]
CODE_TASKS = ["reverses a string", "checks whether a number is prime", "computes the factorial of n",
              "returns the n-th Fibonacci number", "counts the vowels in a string", "merges two sorted lists",
              "removes duplicates from a list", "finds the largest element in an array", "checks if a string is a palindrome",
              "converts Celsius to Fahrenheit", "sorts a list of words by length", "computes the average of a list of numbers",
              "reads a file and counts its lines", "validates an email address", "flattens a nested list",
              "returns the greatest common divisor of two integers", "implements binary search", "capitalizes every word in a sentence",
              "parses a CSV line into fields", "computes the sum of the digits of a number", "transposes a matrix",
              "finds all anagrams of a word in a list", "implements a stack with push and pop", "counts word frequencies in a text",
              "generates all permutations of a list", "checks whether two strings are rotations of each other",
              "converts a Roman numeral to an integer", "rotates an array by k positions", "implements bubble sort",
              "returns the longest common prefix of a list of strings", "computes the power set of a set",
              "implements a simple LRU cache", "checks balanced parentheses", "converts a number to binary",
              "finds the second largest number in a list", "computes the dot product of two vectors"]
SNIPPETS = {
    "Python": ["def add(a, b):\n    return a - b", "for i in range(10):\n    print(i * i)", "nums = [3, 1, 2]\nnums.sort()\nprint(nums[0])",
               "class Dog:\n    def __init__(self, name):\n        self.name = name\n    def bark(self):\n        return self.name + ' says woof'",
               "with open('data.txt') as f:\n    lines = f.readlines()\nprint(len(lines))", "squares = {x: x**2 for x in range(5)}"],
    "JavaScript": ["const xs = [1, 2, 3].map(x => x * 2);\nconsole.log(xs);", "function greet(name) {\n  return `Hello, ${name}!`;\n}",
                   "let total = 0;\nfor (const n of [4, 5, 6]) total += n;", "fetch(url).then(r => r.json()).then(data => console.log(data));"],
    "Rust": ["fn main() {\n    let v = vec![1, 2, 3];\n    let s: i32 = v.iter().sum();\n    println!(\"{}\", s);\n}",
             "fn square(x: u64) -> u64 {\n    x * x\n}", "let mut s = String::new();\ns.push_str(\"hi\");"],
    "C": ["int main(void) {\n    int a[5] = {1, 2, 3, 4, 5};\n    int s = 0;\n    for (int i = 0; i <= 5; i++) s += a[i];\n    return s;\n}",
          "char *p = malloc(10);\nstrcpy(p, \"hello\");\nprintf(\"%s\\n\", p);"],
    "Go": ["func sum(xs []int) int {\n\ttotal := 0\n\tfor _, x := range xs {\n\t\ttotal += x\n\t}\n\treturn total\n}"],
    "Java": ["public static int max(int[] a) {\n    int m = a[0];\n    for (int x : a) if (x > m) m = x;\n    return m;\n}"],
}
SQL_TASKS = ["lists all customers from Canada", "counts orders per customer", "finds the five most expensive products",
             "returns employees hired after 2020", "computes the average salary by department", "deletes rows with a null email",
             "joins orders with customers and shows the customer name", "finds duplicate usernames"]
CODE_QUESTIONS = ["read a JSON file", "sort a dictionary by value", "make an HTTP request", "handle exceptions",
                  "create a class", "write unit tests", "use a hash map", "iterate over a list with indices", "format a date",
                  "spawn a thread", "parse command-line arguments", "concatenate strings efficiently"]
THINGS = ["books", "movies", "inventions", "animals", "cities", "foods", "careers", "hobbies", "historical events",
          "famous scientists", "board games", "programming languages", "musical instruments", "plants", "sports"]
ACTIVITIES = ["studying for exams", "saving money", "learning to cook", "staying productive at home", "running a first marathon",
              "writing a novel", "keeping houseplants alive", "starting a small business", "traveling on a budget",
              "improving sleep", "learning to draw", "preparing for a job interview", "organizing a closet", "camping in the rain"]
DISHES = ["lasagna", "pancakes", "a vegetable curry", "tacos", "a chocolate cake", "fried rice", "tomato soup",
          "a Greek salad", "banana bread", "mushroom risotto", "chicken noodle soup", "guacamole"]
TASKS = ["change a flat tire", "plant a tree", "make a cup of tea", "set up a new laptop", "write a resume", "bake bread",
         "train a puppy", "paint a room", "file a tax return", "learn a new language", "build a birdhouse", "clean a keyboard"]
CHARACTERS = ["a lonely robot", "a young wizard", "an old fisherman", "a curious cat", "a detective in Paris",
              "a girl who can talk to birds", "a retired astronaut", "a baker in a small village", "a dragon afraid of fire",
              "two siblings lost in a forest", "a time traveler", "a street musician", "a lighthouse keeper", "a nervous knight"]
EVENTS = ["finds a mysterious map", "wakes up with no memory", "discovers a hidden door", "wins an unexpected prize",
          "meets a stranger on a train", "has to save the village", "loses something precious", "learns a secret",
          "builds a machine", "gets lost during a storm"]
PLACES = ["a busy market at dawn", "an abandoned castle", "a quiet library", "a beach at sunset", "a spaceship cockpit",
          "a snowy mountain village", "a crowded subway station", "a rainforest canopy", "a grandmother's kitchen", "a desert oasis"]
NAMES = ["Alice", "Bob", "Carlos", "Diana", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kim", "Liam", "Maya", "Noah",
         "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tomas", "Uma", "Victor", "Wen", "Yusuf", "Zoe"]
ROLES = ["travel agent", "librarian", "personal trainer", "chef", "tech support agent", "museum guide", "doctor",
         "math tutor", "bank teller", "gardener"]
LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese", "Japanese", "Chinese", "Dutch"]
SENTENCES = ["The weather is nice today.", "I would like a cup of coffee, please.", "Where is the train station?",
             "We are going to the beach this weekend.", "My brother loves playing football.", "This book is very interesting.",
             "Please close the door when you leave.", "The meeting starts at nine o'clock.", "I can't find my keys anywhere.",
             "Thank you for your help yesterday."]
PARAS = ["The city council met on Tuesday to discuss the new park. Residents raised concerns about parking and noise, "
         "while supporters argued that the park would give children a safe place to play. A vote is expected next month.",
         "Scientists have discovered a new species of frog in the mountains of Peru. The frog is bright orange and only "
         "two centimeters long. Researchers believe it lives in a very small area and may be endangered.",
         "The company reported higher profits this quarter, driven by strong sales of its new phone. However, costs also "
         "rose because of supply problems, and the company warned that next quarter may be weaker.",
         "Regular exercise improves mood, sleep and heart health. Experts recommend at least 150 minutes of moderate "
         "activity each week, such as brisk walking or cycling, along with two days of strength training.",
         "The museum's new exhibit features paintings from the nineteenth century, many of which have never been shown "
         "in public. Tickets are free for students, and the exhibit runs until the end of the year."]
SUBJECTS = ["a delayed shipment", "a meeting next week", "a job application", "a refund request", "a team lunch",
            "a project deadline", "a thank-you note", "a room booking", "a new policy", "a birthday party"]
PRODUCTS = ["a reusable water bottle", "noise-cancelling headphones", "a smart thermostat", "a folding bicycle",
            "an ergonomic chair", "a solar phone charger", "a cast iron skillet", "a mechanical keyboard"]
MODULES = ["os", "sys", "json", "re", "math", "random", "collections", "itertools", "numpy as np", "pandas as pd", "torch"]
FNAMES = ["process_data", "load_config", "parse_args", "compute_stats", "render_page", "send_email", "train_model",
          "normalize", "fetch_user", "merge_records", "validate_input", "build_index"]
OPENINGS = ["It was raining when", "Nobody in the village believed", "The letter arrived on a Monday", "She had never seen",
            "At the edge of the map", "The last train of the night", "When the power went out", "My grandfather used to say"]
RECIPIENTS = ["my manager", "a customer", "my landlord", "the school principal", "a colleague", "an old friend", "the hiring team"]
CANNED = ["Sure! Here is a short answer.", "Of course. Let me explain.", "That's a great question.",
          "Here are a few ideas.", "Certainly, I can help with that."]
FOLLOWUPS = ["Can you give me an example?", "Can you make it shorter?", "Explain that in simpler words.",
             "What else should I know?", "Can you write it as a list?", "Thanks! Can you add more detail?",
             "Now do the same in Spanish.", "Why is that?"]

HANDWRITTEN_TRAIN = [
    "Write a limerick about a cat who loves lasagna.",
    "What's the difference between a list and a tuple in Python?",
    "Give me a 3-day itinerary for Rome.",
    "Tell me a joke about programmers.",
    "How many legs does a spider have, and why?",
    "Write a short motivational speech for a soccer team at halftime.",
    "Explain recursion using an everyday example.",
    "What should I pack for a week-long hiking trip?",
    "Describe the taste of a lemon to someone who has never had one.",
    "Write a bash script that backs up a directory to a tar.gz file with today's date in the name.",
    "Write a regular expression that matches a US phone number and explain it.",
    "Convert this JSON to YAML: {\"name\": \"Ada\", \"skills\": [\"math\", \"code\"], \"age\": 36}",
    "Write a cover letter for a junior data analyst position.",
    "What are the main causes of World War I?",
    "Write a dialogue between a teacher and a student who forgot their homework.",
    "Explain the rules of tic-tac-toe.",
    "Write the opening paragraph of a mystery novel set on a train.",
    "What is the capital of Australia, and why isn't it Sydney?",
    "Create a weekly workout plan for a beginner.",
    "Write a Python class representing a bank account with deposit and withdraw methods.",
]
HANDWRITTEN_HELDOUT = [
    "Write a sonnet about a broken umbrella.",
    "Explain how a refrigerator keeps food cold.",
    "Give me five names for a bakery that sells only croissants.",
    "Write a Python function that returns the median of a list of numbers.",
    "A shop sells pens at 3 dollars each. How much do 17 pens cost?",
    "Write a dialogue between a pirate and a parrot who wants to retire.",
    "What are the benefits of learning to play the piano as an adult?",
    "List the planets of the solar system in order from the Sun.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "How do I undo the last commit in git?",
    "Write a haiku about a traffic jam.",
    "Explain what an API is to a restaurant owner.",
    "Write a JavaScript function that debounces another function.",
    "What is 15% of 240? Show your work.",
    "Describe a futuristic city in the year 2300.",
    "Write a polite email declining a wedding invitation.",
]

HELDOUT_EVERY = 8


def _split(pool):
    train = [x for i, x in enumerate(pool) if i % HELDOUT_EVERY != 3]
    held = [x for i, x in enumerate(pool) if i % HELDOUT_EVERY == 3]
    return train, held


def chat(user, sys_prefix=None):
    body = (sys_prefix + "\n\n" + user) if sys_prefix else user
    return "<start_of_turn>user\n" + body + "<end_of_turn>\n<start_of_turn>model\n"


def chat2(u1, a1, u2):
    return ("<start_of_turn>user\n" + u1 + "<end_of_turn>\n<start_of_turn>model\n" + a1 + "<end_of_turn>\n"
            "<start_of_turn>user\n" + u2 + "<end_of_turn>\n<start_of_turn>model\n")


class Pools:
    def __init__(self, held):
        def pick(pool):
            tr, he = _split(pool)
            return he if held else tr
        self.topic = pick(TOPICS)
        self.aud = AUDIENCES
        self.lang = LANGS
        self.code_task = pick(CODE_TASKS)
        self.sql = pick(SQL_TASKS)
        self.codeq = pick(CODE_QUESTIONS)
        self.things = THINGS
        self.activity = pick(ACTIVITIES)
        self.dish = pick(DISHES)
        self.task = pick(TASKS)
        self.character = pick(CHARACTERS)
        self.event = EVENTS
        self.place = pick(PLACES)
        self.name = NAMES
        self.role = ROLES
        self.language = LANGUAGES
        self.sentence = SENTENCES
        self.para = PARAS
        self.subject = pick(SUBJECTS)
        self.product = pick(PRODUCTS)
        self.module = MODULES
        self.fname = FNAMES
        self.opening = OPENINGS
        self.recipient = RECIPIENTS


def _math(r, held):
    # Held-out math uses number ranges the training prompts never use.
    lo, hi = (1000, 9999) if held else (2, 999)
    a, b, c = r.randint(lo, hi), r.randint(lo, hi), r.randint(lo, hi)
    k = r.randint(2, 9)
    forms = [
        f"What is {a} + {b}?", f"What is {a} - {b}?", f"Compute {a} * {k} step by step.",
        f"Solve for x: {k}x + {a} = {b}.", f"What is {k * 5}% of {a}?", f"Is {a} a prime number? Explain.",
        f"Simplify the fraction {a}/{b}.", f"A train travels {a} km in {k} hours. What is its average speed?",
        f"If a shirt costs ${a} and is discounted by {k * 5}%, what is the new price?",
        f"Sarah has {a} apples and gives {k} to each of her {k + 1} friends. How many apples does she have left?",
        f"What is the area of a rectangle that is {a} cm long and {k} cm wide?",
        f"Convert {a} minutes into hours and minutes.", f"Find the next number in the sequence: {k}, {2 * k}, {4 * k}, {8 * k}, ...",
        f"Round {a}.{b} to the nearest ten.", f"What is the square of {k + 10}?",
        f"Problem: A box holds {k} rows of {a % 50 + 2} eggs. How many eggs are in {k + 2} boxes?\nSolution:",
    ]
    return r.choice(forms)


def _chat_user(r, P, held):
    kind = r.choice(["qa", "qa", "list", "list", "prose", "prose", "code", "code", "code", "math", "dialogue",
                     "rewrite", "email"])
    t = r.choice(P.topic)
    if kind == "qa":
        s = r.choice([f"What is {t}?", f"Explain {t} to {r.choice(P.aud)}.", f"Why is {t} important?",
                      f"How does {t} work?", f"Give me three interesting facts about {t}.",
                      f"What are the pros and cons of {t}?", f"What is the history of {t}?",
                      f"Q: What do people usually get wrong about {t}?", f"Tell me something surprising about {t}.",
                      f"Compare {t} and {r.choice(P.topic)}."])
    elif kind == "list":
        n = r.randint(3, 10)
        s = r.choice([f"List {n} {r.choice(P.things)} related to {t}.", f"Give me a numbered list of {n} tips for {r.choice(P.activity)}.",
                      f"Make a shopping list for {r.choice(P.dish)}.", f"List the steps to {r.choice(P.task)}.",
                      f"What are {n} common mistakes when {r.choice(P.activity)}?", f"Write a recipe for {r.choice(P.dish)}.",
                      f"Give me {n} ideas for a blog post about {t}.", f"Outline an essay about {t} with headings."])
    elif kind == "prose":
        s = r.choice([f"Write a short story about {r.choice(P.character)} who {r.choice(P.event)}.",
                      f"Write a poem about {t}.", f"Write a haiku about {t}.", f"Describe {r.choice(P.place)}.",
                      f"Write a product description for {r.choice(P.product)}.",
                      f"Write a short speech about {t}.", f"Write a fairy tale about {r.choice(P.character)}.",
                      f"Continue the story: {r.choice(P.opening)} {r.choice(P.character)} {r.choice(P.event)}."])
    elif kind == "code":
        lang = r.choice(P.lang)
        snips = SNIPPETS.get(lang)
        forms = [f"Write a {lang} function that {r.choice(P.code_task)}.", f"How do I {r.choice(P.codeq)} in {lang}?",
                 f"Write a SQL query that {r.choice(P.sql)}.", f"Write a {lang} program that {r.choice(P.code_task)} and add comments."]
        if snips:
            sn = r.choice(snips)
            forms += [f"Explain this code:\n```{lang.lower()}\n{sn}\n```", f"Find the bug in this {lang} code:\n```\n{sn}\n```",
                      f"Add type hints and docstrings to this code:\n{sn}"]
        s = r.choice(forms)
    elif kind == "math":
        s = _math(r, held)
    elif kind == "dialogue":
        a, b = r.sample(P.name, 2)
        s = r.choice([f"Write a dialogue between {a} and {b} about {t}.", f"Role-play: you are a {r.choice(P.role)}. "
                      f"A customer named {a} asks you about {t}. Reply to them.",
                      f"Write a conversation between {r.choice(P.character)} and {r.choice(P.character)}."])
    elif kind == "rewrite":
        s = r.choice([f"Translate to {r.choice(P.language)}: {r.choice(P.sentence)}",
                      f"Rewrite this sentence more formally: {r.choice(P.sentence)}",
                      f"Summarize the following text:\n{r.choice(P.para)}",
                      f"Give a title to this paragraph:\n{r.choice(P.para)}",
                      f"Correct the grammar: {r.choice(['me and him goes to school', 'she dont like apples', 'their going to the park tomorow', 'I has three cat'])}"])
    else:
        s = f"Write an email to {r.choice(P.recipient)} about {r.choice(P.subject)}."
    return kind, s


def _raw(r, P, held):
    t = r.choice(P.topic)
    T = t[0].upper() + t[1:]
    kind = r.choice(["raw-prose", "raw-prose", "raw-code", "raw-code", "raw-list", "raw-qa", "raw-dialogue", "raw-math"])
    if kind == "raw-prose":
        s = r.choice([f"The history of {t}", f"{T} is", f"Chapter {r.randint(1, 30)}\n\n{r.choice(P.opening)}",
                      f"Once upon a time, {r.choice(P.character)}", f"# {T}\n\n## Introduction\n\n",
                      f"In this article, we will explore {t}.", f"Dear {r.choice(P.name)},\n\n",
                      f"BREAKING: New report on {t}", f"{r.choice(P.opening)}", f"Many people wonder why {t}",
                      f"Abstract\n\nThis paper studies {t}.", f"My favorite thing about {t} is"])
    elif kind == "raw-code":
        lang = r.choice(["py", "py", "c", "rs", "js", "go", "sh", "sql"])
        f = r.choice(P.fname)
        s = {"py": r.choice([f"import {r.choice(P.module)}\n\n\ndef {f}(", f"def {f}(data):\n    \"\"\"", f"class {T.split()[0].capitalize()}Manager:\n    def __init__(self"]),
             "c": "#include <stdio.h>\n#include <stdlib.h>\n\nint main(void) {\n",
             "rs": r.choice(["fn main() {\n", f"pub fn {f}(input: &str) -> ", "use std::collections::HashMap;\n\n"]),
             "js": r.choice([f"function {f}(items) {{\n", f"const {f} = async (url) => {{\n"]),
             "go": "package main\n\nimport \"fmt\"\n\nfunc main() {\n",
             "sh": "#!/bin/bash\n# Usage: ./backup.sh <dir>\n",
             "sql": r.choice(["SELECT name, COUNT(*)\nFROM", "CREATE TABLE users (\n"])}[lang]
    elif kind == "raw-list":
        n = r.randint(3, 12)
        s = r.choice([f"Top {n} {r.choice(P.things)}:\n1.", f"Ingredients for {r.choice(P.dish)}:\n- ",
                      f"Things to know about {t}:\n\n1. ", f"Steps to {r.choice(P.task)}:\n1."])
    elif kind == "raw-qa":
        s = r.choice([f"Q: What is {t}?\nA:", f"Question: How does {t} work?\nAnswer:", f"FAQ\n\nWhat is {t}?\n"])
    elif kind == "raw-dialogue":
        a, b = r.sample(P.name, 2)
        s = r.choice([f"{a}: Have you heard about {t}?\n{b}:", f"User: Tell me about {t}.\nAssistant:",
                      f"INTERVIEWER: Today we're talking about {t}.\n"])
    else:
        s = _math(r, held) + ("\n" if r.random() < 0.5 else " ")
    return kind, s


def build(seed=1234, n_train=12000, n_heldout=384):
    out = []
    for held, n in ((False, n_train), (True, n_heldout)):
        r = random.Random(seed + (7919 if held else 0))
        P = Pools(held)
        seen = set()
        items = []
        seeds = HANDWRITTEN_HELDOUT if held else HANDWRITTEN_TRAIN
        for s in seeds:
            items.append({"kind": "seed", "chat": True, "text": chat(s)})
            seen.add(items[-1]["text"])
        tries = 0
        while len(items) < n and tries < n * 50:
            tries += 1
            u = r.random()
            if u < 0.55:
                kind, s = _chat_user(r, P, held)
                sysp = r.choice([None] * 6 + ["You are a helpful assistant.", "Answer briefly.", "You are an expert tutor."])
                text = chat(s, sysp)
                is_chat = True
            elif u < 0.65:
                kind, s1 = _chat_user(r, P, held)
                text = chat2(s1, r.choice(CANNED), r.choice(FOLLOWUPS))
                kind, is_chat = "chat-multi", True
            else:
                kind, text = _raw(r, P, held)
                is_chat = False
            if text in seen:
                continue
            seen.add(text)
            items.append({"kind": kind, "chat": is_chat, "text": text})
        out.append(items)
    train, held = out
    held_texts = set(x["text"] for x in held)
    train = [x for x in train if x["text"] not in held_texts]
    return train, held


if __name__ == "__main__":
    import collections
    tr, he = build()
    print(len(tr), len(he))
    print(collections.Counter(x["kind"] for x in tr).most_common())
    r = random.Random(0)
    for x in r.sample(tr, 12) + r.sample(he, 6):
        print(repr(x["text"]))
