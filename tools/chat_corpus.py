"""Synthetic tool-use conversations for training the small models of tools/train_small_models.py.

Every conversation is a list of OpenAI-style messages (what transformers' apply_chat_template takes)
plus the JSON schemas of the tools offered in it. The assistant always thinks first
(`reasoning_content`), then either answers directly or calls one of three tools with structured
`tool_calls` (arguments as a mapping, so that each chat template writes its own call syntax); a
`tool` message carries the computed result, and the next assistant turn answers from it, copying
the result's numbers exactly. Everything is drawn from a seeded `random.Random`, so a seed gives the
same conversations on every machine.

    from chat_corpus import make_conversations
    for messages, tools in make_conversations(seed=1, count=3):
        ...

The tools:
  calculator(expression)                  the value of + - * / expressions, rounded to 4 decimals
  convert_units(value, from_unit, to_unit) lengths, masses, volumes, temperatures, times
  lookup(table, key)                      a record of the `cities` or `elements` table below
The city figures are rounded, illustrative values; the element data are standard values.
"""
from __future__ import annotations

import json
import random

# ---------------------------------------------------------------------------------------------
# The tools and the data behind them
# ---------------------------------------------------------------------------------------------

CITIES = [  # name, country, population (rounded), elevation in metres
    ("Paris", "France", 2102650, 35), ("Lyon", "France", 522250, 173), ("Berlin", "Germany", 3878100, 34),
    ("Munich", "Germany", 1512491, 519), ("Madrid", "Spain", 3332035, 657), ("Barcelona", "Spain", 1620343, 12),
    ("Rome", "Italy", 2748109, 21), ("Milan", "Italy", 1371498, 120), ("Lisbon", "Portugal", 545796, 45),
    ("Vienna", "Austria", 2005760, 190), ("Prague", "Czechia", 1357326, 235), ("Warsaw", "Poland", 1861975, 100),
    ("Oslo", "Norway", 709037, 23), ("Stockholm", "Sweden", 984748, 28), ("Helsinki", "Finland", 674963, 17),
    ("Dublin", "Ireland", 592713, 20), ("Amsterdam", "Netherlands", 931298, -2), ("Zurich", "Switzerland", 443037, 408),
    ("Athens", "Greece", 643452, 70), ("Cairo", "Egypt", 10107125, 23), ("Nairobi", "Kenya", 4397073, 1795),
    ("Lagos", "Nigeria", 8048430, 41), ("Tokyo", "Japan", 14094034, 40), ("Osaka", "Japan", 2752412, 12),
    ("Seoul", "South Korea", 9386034, 38), ("Beijing", "China", 21893095, 44), ("Mumbai", "India", 12442373, 14),
    ("Bangkok", "Thailand", 5494932, 2), ("Sydney", "Australia", 5450496, 58), ("Toronto", "Canada", 2794356, 76),
    ("Denver", "United States", 715522, 1609), ("Chicago", "United States", 2665039, 181),
    ("Mexico City", "Mexico", 9209944, 2240), ("Lima", "Peru", 9943800, 154), ("Bogota", "Colombia", 7907281, 2640),
    ("Quito", "Ecuador", 2800388, 2850), ("Reykjavik", "Iceland", 139875, 15), ("La Paz", "Bolivia", 755732, 3640),
    ("Cape Town", "South Africa", 4772846, 25),
]

ELEMENTS = [  # name, symbol, atomic number, standard atomic mass
    ("Hydrogen", "H", 1, 1.008), ("Helium", "He", 2, 4.0026), ("Lithium", "Li", 3, 6.94),
    ("Beryllium", "Be", 4, 9.0122), ("Boron", "B", 5, 10.81), ("Carbon", "C", 6, 12.011),
    ("Nitrogen", "N", 7, 14.007), ("Oxygen", "O", 8, 15.999), ("Fluorine", "F", 9, 18.998),
    ("Neon", "Ne", 10, 20.18), ("Sodium", "Na", 11, 22.99), ("Magnesium", "Mg", 12, 24.305),
    ("Aluminium", "Al", 13, 26.982), ("Silicon", "Si", 14, 28.085), ("Phosphorus", "P", 15, 30.974),
    ("Sulfur", "S", 16, 32.06), ("Chlorine", "Cl", 17, 35.45), ("Argon", "Ar", 18, 39.948),
    ("Potassium", "K", 19, 39.098), ("Calcium", "Ca", 20, 40.078), ("Titanium", "Ti", 22, 47.867),
    ("Iron", "Fe", 26, 55.845), ("Nickel", "Ni", 28, 58.693), ("Copper", "Cu", 29, 63.546),
    ("Zinc", "Zn", 30, 65.38), ("Silver", "Ag", 47, 107.87), ("Tin", "Sn", 50, 118.71),
    ("Gold", "Au", 79, 196.97), ("Mercury", "Hg", 80, 200.59), ("Lead", "Pb", 82, 207.2),
    ("Uranium", "U", 92, 238.03),
]

# unit -> (spoken name, kind, factor to the kind's base unit); temperatures are converted by formula.
UNITS = {
    "km": ("kilometers", "length", 1000.0), "m": ("meters", "length", 1.0), "cm": ("centimeters", "length", 0.01),
    "mi": ("miles", "length", 1609.344), "ft": ("feet", "length", 0.3048), "in": ("inches", "length", 0.0254),
    "kg": ("kilograms", "mass", 1.0), "g": ("grams", "mass", 0.001), "lb": ("pounds", "mass", 0.45359237),
    "oz": ("ounces", "mass", 0.028349523125),
    "L": ("liters", "volume", 1.0), "mL": ("milliliters", "volume", 0.001), "gal": ("US gallons", "volume", 3.785411784),
    "h": ("hours", "time", 3600.0), "min": ("minutes", "time", 60.0), "s": ("seconds", "time", 1.0),
    "day": ("days", "time", 86400.0),
    "C": ("degrees Celsius", "temperature", None), "F": ("degrees Fahrenheit", "temperature", None),
    "K": ("kelvin", "temperature", None),
}

TOOLS = {
    "calculator": {"type": "function", "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses; returns its value.",
        "parameters": {"type": "object", "properties": {
            "expression": {"type": "string", "description": "The expression, for example \"(12 + 7) * 3\"."}},
            "required": ["expression"]}}},
    "convert_units": {"type": "function", "function": {
        "name": "convert_units",
        "description": "Convert a quantity from one unit to another (length, mass, volume, time, temperature).",
        "parameters": {"type": "object", "properties": {
            "value": {"type": "number", "description": "The quantity to convert."},
            "from_unit": {"type": "string", "enum": sorted(UNITS), "description": "The unit of `value`."},
            "to_unit": {"type": "string", "enum": sorted(UNITS), "description": "The unit wanted."}},
            "required": ["value", "from_unit", "to_unit"]}}},
    "lookup": {"type": "function", "function": {
        "name": "lookup",
        "description": "Look up a record in a reference table: `cities` (country, population, elevation_m) "
                       "or `elements` (symbol, atomic_number, atomic_mass).",
        "parameters": {"type": "object", "properties": {
            "table": {"type": "string", "enum": ["cities", "elements"]},
            "key": {"type": "string", "description": "The city or element name, for example \"Lyon\" or \"Iron\"."}},
            "required": ["table", "key"]}}},
}

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Use the tools when they help.",
    "Answer briefly. Use the calculator for arithmetic, convert_units for units and lookup for facts.",
    "You are a careful assistant: check numbers with a tool before you answer.",
]


def number_text(value: float) -> str:
    """How a number is written everywhere (questions, arguments, results, answers): integers without
    a decimal point, other values with at most 4 decimals, as Python and JSON print them."""
    value = round(float(value), 4)
    return str(int(value)) if value == int(value) else repr(value)


def number_value(value: float):
    """The JSON value of a number: an int when whole, so that "12" and not "12.0" is rendered."""
    value = round(float(value), 4)
    return int(value) if value == int(value) else value


def convert(value: float, source: str, target: str) -> float:
    if UNITS[source][1] == "temperature":
        celsius = {"C": value, "F": (value - 32) * 5 / 9, "K": value - 273.15}[source]
        return {"C": celsius, "F": celsius * 9 / 5 + 32, "K": celsius + 273.15}[target]
    return value * UNITS[source][2] / UNITS[target][2]


def lookup_record(table: str, key: str) -> dict:
    if table == "cities":
        name, country, population, elevation = next(c for c in CITIES if c[0] == key)
        return {"name": name, "country": country, "population": population, "elevation_m": elevation}
    name, symbol, number, mass = next(e for e in ELEMENTS if e[0] == key)
    return {"name": name, "symbol": symbol, "atomic_number": number, "atomic_mass": mass}


# ---------------------------------------------------------------------------------------------
# Tasks: one user request each, with the tool call it needs and the answer from the result
# ---------------------------------------------------------------------------------------------

class Task:
    """One request: `question` (user text), `calls` [(tool name, arguments)], `results` (one JSON-able
    value per call), and `answer(results)` / `plan` / `conclusion` texts for the assistant."""

    def __init__(self, question, calls, results, plan, conclusion, answer):
        self.question, self.calls, self.results = question, calls, results
        self.plan, self.conclusion, self.answer = plan, conclusion, answer


def arithmetic_task(rng: random.Random) -> Task:
    def operand():
        return rng.choice([rng.randint(2, 99), rng.randint(10, 999), rng.randint(100, 9999),
                           round(rng.uniform(0.5, 99), rng.choice([1, 2]))])
    a, b = operand(), operand()
    op = rng.choice("+-*/")
    words = {"+": ("plus", "the sum of {a} and {b}", "What do you get if you add {a} and {b}?"),
             "-": ("minus", "{a} minus {b}", "Subtract {b} from {a}."),
             "*": ("times", "the product of {a} and {b}", "Multiply {a} by {b}."),
             "/": ("divided by", "{a} divided by {b}", "Divide {a} by {b}.")}[op]
    A, B = number_text(a), number_text(b)
    if rng.random() < 0.3:
        c, op2 = operand(), rng.choice("+-*")
        expression = f"({A} {op} {B}) {op2} {number_text(c)}"
        value = eval(f"({a} {op} {b}) {op2} {c}")  # noqa: S307 - built from numbers and operators above
        question = rng.choice(["What is {e}?", "Compute {e}.", "Can you calculate {e} for me?",
                               "Please work out {e}.", "How much is {e}?", "{e} = ?"]).format(e=expression)
    else:
        expression = f"{A} {op} {B}"
        value = eval(f"{a} {op} {b}")  # noqa: S307
        question = rng.choice([
            "What is {e}?", "Compute {e}.", "Can you calculate {e} for me?", "How much is {e}?", "{e} = ?",
            "What is {a} " + words[0] + " {b}?", "What is " + words[1] + "?", words[2], "I need " + words[1] + ".",
        ]).format(e=expression, a=A, b=B)
    result = number_text(value)
    return Task(
        question, [("calculator", {"expression": expression})], [{"result": number_value(value)}],
        rng.choice([f"The user wants {expression}. I will use the calculator.",
                    f"I need to compute {expression}; the calculator tool does that.",
                    f"Let me evaluate {expression} with the calculator rather than by hand."]),
        lambda results: rng.choice([f"The calculator returned {result}.",
                                    f"The tool says {expression} = {result}.",
                                    f"Result: {result}. I can answer now."]),
        lambda results: rng.choice([f"{expression} = {result}.", f"The answer is {result}.",
                                    f"It comes out to {result}.", f"{result}"]),
    )


def conversion_task(rng: random.Random) -> Task:
    kind = rng.choice(["length", "length", "mass", "volume", "time", "temperature"])
    source, target = rng.sample([u for u, spec in UNITS.items() if spec[1] == kind], 2)
    value = rng.choice([rng.randint(1, 500), round(rng.uniform(0.1, 250), 1)])
    if kind == "temperature":
        value = rng.randint(-40, 230) if source != "K" else rng.randint(200, 500)
    V = number_text(value)
    result = number_text(convert(value, source, target))
    source_name, target_name = UNITS[source][0], UNITS[target][0]
    question = rng.choice([
        f"How many {target_name} is {V} {source_name}?", f"Convert {V} {source} to {target}.",
        f"Convert {V} {source_name} to {target_name}, please.", f"What is {V} {source} in {target}?",
        f"I have {V} {source_name}. How much is that in {target_name}?", f"{V} {source} -> {target}?",
    ])
    return Task(
        question, [("convert_units", {"value": number_value(value), "from_unit": source, "to_unit": target})],
        [{"value": number_value(convert(value, source, target)), "unit": target}],
        rng.choice([f"This is a unit conversion from {source} to {target}; I'll call convert_units.",
                    f"The user wants {V} {source} expressed in {target}. convert_units can do it.",
                    f"Convert {V} {source_name} to {target_name} with the conversion tool."]),
        lambda results: rng.choice([f"convert_units gave {result} {target}.",
                                    f"The result is {result} {target}.",
                                    f"So {V} {source} = {result} {target}."]),
        lambda results: rng.choice([f"{V} {source} is {result} {target}.",
                                    f"{V} {source_name} is about {result} {target_name}.",
                                    f"That is {result} {target}.", f"It's {result} {target_name}."]),
    )


def lookup_task(rng: random.Random) -> Task:
    if rng.random() < 0.55:
        name, country, population, elevation = rng.choice(CITIES)
        field = rng.choice(["country", "population", "elevation_m"])
        question = {
            "country": [f"Which country is {name} in?", f"In what country is {name}?", f"{name} is in which country?"],
            "population": [f"What is the population of {name}?", f"How many people live in {name}?",
                           f"How big is {name} by population?"],
            "elevation_m": [f"How high above sea level is {name}?", f"What is the elevation of {name}?",
                            f"At what altitude is {name}?"],
        }[field]
        record = lookup_record("cities", name)
        value = number_text(record[field]) if field != "country" else record[field]
        answers = {
            "country": [f"{name} is in {value}.", f"It is in {value}.", value],
            "population": [f"{name} has a population of {value}.", f"About {value} people live in {name}.",
                           f"{value}."],
            "elevation_m": [f"{name} lies at {value} m above sea level.", f"Its elevation is {value} m.",
                            f"{value} meters."],
        }[field]
        table = "cities"
    else:
        name, symbol, number, mass = rng.choice(ELEMENTS)
        field = rng.choice(["symbol", "atomic_number", "atomic_mass"])
        question = {
            "symbol": [f"What is the chemical symbol of {name}?", f"Which symbol stands for {name}?"],
            "atomic_number": [f"What is the atomic number of {name}?", f"How many protons does {name} have?"],
            "atomic_mass": [f"What is the atomic mass of {name}?", f"How heavy is an atom of {name}, in u?"],
        }[field]
        record = lookup_record("elements", name)
        value = number_text(record[field]) if field != "symbol" else record[field]
        answers = {
            "symbol": [f"The symbol of {name} is {value}.", f"{value}."],
            "atomic_number": [f"{name} has atomic number {value}.", f"{value}."],
            "atomic_mass": [f"The atomic mass of {name} is {value} u.", f"About {value} u."],
        }[field]
        table = "elements"
    return Task(
        rng.choice(question), [("lookup", {"table": table, "key": name})], [record],
        rng.choice([f"I should look up {name} in the {table} table.",
                    f"The {table} table has {name}; I'll use lookup and read the {field} field.",
                    f"Let me check the {field} of {name} with the lookup tool."]),
        lambda results: rng.choice([f"The record says {field} = {value}.", f"The {field} of {name} is {value}.",
                                    f"lookup returned {field}: {value}."]),
        lambda results: rng.choice(answers),
    )


def paired_task(rng: random.Random) -> Task:
    """Two independent requests in one question: two tool calls in one assistant message."""
    first, second = [rng.choice([arithmetic_task, conversion_task, lookup_task])(rng) for _ in range(2)]
    question = first.question + rng.choice([" Also: ", " And: ", " Second question: "]) + second.question
    return Task(
        question, first.calls + second.calls, first.results + second.results,
        "Two separate requests; I can make both tool calls at once. " + first.plan + " " + second.plan,
        lambda results: first.conclusion(results[:1]) + " " + second.conclusion(results[1:]),
        lambda results: first.answer(results[:1]) + " " + second.answer(results[1:]),
    )


def small_talk(rng: random.Random, tools: list[str], first_turn: bool):
    """(question, reasoning, answer) for a turn that needs no tool."""
    names = ", ".join(tools)
    options = [
        (rng.choice(["Hi!", "Hello.", "Hey there!", "Good morning!"]), "A greeting; no tool is needed.",
         rng.choice(["Hello! How can I help you today?", "Hi! What can I do for you?"])),
        (rng.choice(["What can you do?", "Which tools do you have?", "What tools can you use?"]),
         f"The user asks about my tools. The tools offered here are: {names}.",
         f"I can use these tools: {names}."),
    ]
    if not first_turn:
        options.append((rng.choice(["Thanks!", "Thank you.", "Great, thanks."]),
                        "The user is thanking me; no tool is needed.",
                        rng.choice(["You're welcome!", "Glad I could help.", "Any time!"])))
    return rng.choice(options)


# ---------------------------------------------------------------------------------------------
# Conversations
# ---------------------------------------------------------------------------------------------

def make_conversation(rng: random.Random) -> tuple[list[dict], list[dict]]:
    """One conversation: (messages, tool schemas)."""
    # Several exchanges per conversation: the template's preamble (tool schemas, instructions) costs
    # hundreds of tokens, the exchanges that teach tool use about 100 each.
    turns = rng.choices([1, 2, 3, 4], weights=[3, 3, 2, 2])[0]
    tasks = []
    for turn in range(turns):
        if rng.random() < 0.12:
            tasks.append(None)  # small talk
        else:
            tasks.append(rng.choices([arithmetic_task, conversion_task, lookup_task, paired_task],
                                     weights=[3, 3, 3, 1])[0](rng))
    needed = {name for task in tasks if task for name, _ in task.calls}
    offered = sorted(needed | {name for name in TOOLS if rng.random() < 0.5})
    rng.shuffle(offered)

    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    call_number = 0
    for turn, task in enumerate(tasks):
        if task is None:
            question, reasoning, answer = small_talk(rng, offered, first_turn=turn == 0)
            messages.append({"role": "user", "content": question})
            messages.append({"role": "assistant", "content": answer, "reasoning_content": reasoning})
            continue
        messages.append({"role": "user", "content": task.question})
        calls = []
        for name, arguments in task.calls:
            # Kimi's id form, functions.<name>:<n>; the other templates ignore the id.
            calls.append({"id": f"functions.{name}:{call_number}", "type": "function",
                          "function": {"name": name, "arguments": arguments}})
            call_number += 1
        messages.append({"role": "assistant", "content": "", "reasoning_content": task.plan, "tool_calls": calls})
        for call, result in zip(calls, task.results):
            messages.append({"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"],
                             "content": json.dumps(result)})
        messages.append({"role": "assistant", "content": task.answer(task.results),
                         "reasoning_content": task.conclusion(task.results)})
    return messages, [TOOLS[name] for name in offered]


def make_conversations(seed: int, count: int) -> list[tuple[list[dict], list[dict]]]:
    rng = random.Random(seed)
    return [make_conversation(rng) for _ in range(count)]


def demo_conversation() -> tuple[list[dict], list[dict]]:
    """The fixed conversation the model cards show: a calculator call and the answer from its result."""
    call = {"id": "functions.calculator:0", "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": "48 * 17"}}}
    messages = [
        {"role": "user", "content": "What is 48 * 17?"},
        {"role": "assistant", "content": "", "reasoning_content": "The user wants 48 * 17. I will use the calculator.",
         "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "name": "calculator", "content": json.dumps({"result": 816})},
        {"role": "assistant", "content": "48 * 17 = 816.", "reasoning_content": "The calculator returned 816."},
    ]
    return messages, [TOOLS["calculator"], TOOLS["convert_units"], TOOLS["lookup"]]
