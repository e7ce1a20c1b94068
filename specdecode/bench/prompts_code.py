"""Built-in prompts for the ``code``, ``code-edit`` and ``file-edit`` workloads.

``code`` asks for new code (the draft model's home ground: boilerplate a small model predicts
well); ``code-edit`` hands over code and asks for a rewrite, so much of the answer repeats the
prompt (prompt lookup's home ground). Languages and tasks vary so one idiom does not dominate.
``file-edit`` is OpenAI's predicted-outputs case: a whole file, one small change, the whole file
back, so nearly every answer token is in the prompt (and in the file sent as the prediction).
"""

from __future__ import annotations

CODE: tuple[str, ...] = (
    "Write a Python function `is_palindrome(s: str) -> bool` that ignores case, spaces and "
    "punctuation. Include a docstring and three example calls.",

    "Write a Python function `merge_intervals(intervals: list[tuple[int, int]]) -> "
    "list[tuple[int, int]]` that merges overlapping closed intervals and returns them sorted by "
    "start. Explain the time complexity in one sentence after the code.",

    "Implement an LRU cache class in Python with `get(key)` and `put(key, value)` methods, both "
    "O(1), and a fixed capacity given to the constructor. Do not use functools.lru_cache or "
    "OrderedDict; use a dictionary and a doubly linked list.",

    "Write a JavaScript function `debounce(fn, waitMs)` that returns a debounced version of `fn`. "
    "The returned function should also have a `cancel()` method. Add JSDoc comments.",

    "Write a Rust function `parse_pairs(input: &str) -> Result<HashMap<String, String>, String>` "
    "that parses text like `host=localhost;port=8080;debug=true` into a map. Return an error that "
    "names the offending segment when a segment has no `=`. Include unit tests.",

    "Given the tables `customers(id, name, country)` and `orders(id, customer_id, amount, "
    "created_at)`, write a PostgreSQL query that returns, for each country, the three customers "
    "with the highest total order amount in 2024, with their totals. Use a window function.",

    "Write a Python script that reads a CSV file `sales.csv` with columns `region,product,units,"
    "price` using only the standard library, and prints the total revenue per region sorted from "
    "highest to lowest. Handle a missing file with a clear error message.",

    "Write a Go function `FetchAll(urls []string, workers int) map[string]int` that fetches every "
    "URL concurrently with at most `workers` goroutines at a time and returns each URL's HTTP "
    "status code (or -1 on error). Use a context with a 10 second timeout per request.",

    "Write a C function `struct node *reverse(struct node *head)` that reverses a singly linked "
    "list in place and returns the new head. Show the struct definition and a small `main` that "
    "builds a list of five nodes, reverses it and prints it.",

    "Write a Python function `bisect_left(items: list[int], target: int) -> int` that returns the "
    "insertion point for `target` in the sorted list, then write pytest tests covering an empty "
    "list, duplicates, and targets smaller and larger than every item.",
)

_INVENTORY = '''def total(items):
    t = 0
    for i in items:
        if i["qty"] > 0:
            t = t + i["qty"] * i["price"]
    return t


def low(items, n):
    out = []
    for i in items:
        if i["qty"] < n:
            out.append(i["name"])
    return out'''

_LOOKUP = '''def shipping_cost(country, weight):
    if country == "US":
        if weight < 1:
            return 5
        else:
            return 5 + (weight - 1) * 2
    elif country == "CA":
        if weight < 1:
            return 7
        else:
            return 7 + (weight - 1) * 3
    elif country == "MX":
        if weight < 1:
            return 8
        else:
            return 8 + (weight - 1) * 3
    else:
        raise ValueError("unsupported country")'''

_CALLBACKS = '''function loadUser(id, callback) {
  db.findUser(id, function (err, user) {
    if (err) return callback(err);
    db.findOrders(user.id, function (err, orders) {
      if (err) return callback(err);
      db.findAddress(user.addressId, function (err, address) {
        if (err) return callback(err);
        callback(null, { user: user, orders: orders, address: address });
      });
    });
  });
}'''

_MOVING_AVERAGE = '''def moving_average(values, window):
    """Return the list of averages of each run of `window` consecutive values."""
    result = []
    for i in range(len(values) - window):
        chunk = values[i:i + window]
        result.append(sum(chunk) / window)
    return result


print(moving_average([1, 2, 3, 4, 5], 2))  # expected [1.5, 2.5, 3.5, 4.5]'''

_C_NAMES = '''int f(int *a, int n, int x) {
    int l = 0, h = n - 1, m;
    while (l <= h) {
        m = l + (h - l) / 2;
        if (a[m] == x) return m;
        if (a[m] < x) l = m + 1;
        else h = m - 1;
    }
    return -1;
}'''

_DICT_CLASS = '''class Book:
    def __init__(self, title, author, year, isbn, tags=None):
        self.data = {
            "title": title,
            "author": author,
            "year": year,
            "isbn": isbn,
            "tags": tags if tags is not None else [],
        }

    def get(self, field):
        return self.data[field]

    def __repr__(self):
        return "Book(%s, %s, %s)" % (self.data["title"], self.data["author"], self.data["year"])'''

_PRINTS = '''import json


def load_config(path):
    print("loading config from", path)
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        print("ERROR: config file not found:", path)
        return {}
    print("loaded keys:", list(config))
    if "timeout" not in config:
        print("WARNING: no timeout set, using 30")
        config["timeout"] = 30
    return config'''

_STRINGS = '''def render_report(rows):
    report = ""
    for row in rows:
        if row["active"]:
            line = ""
            line = line + row["name"]
            line = line + ": "
            line = line + str(row["score"])
            report = report + line + "\\n"
    return report'''

CODE_EDIT: tuple[str, ...] = (
    "Add type hints and a docstring to each function below, and rename the functions to "
    "`inventory_value` and `low_stock_names`. Keep the behaviour the same.\n\n```python\n"
    f"{_INVENTORY}\n```",

    "Rewrite this function so that the per-country base price and per-kilogram rate come from a "
    "dictionary instead of the if/elif chain. Keep the same results and the same error.\n\n"
    f"```python\n{_LOOKUP}\n```",

    "Convert this callback-based JavaScript function to use async/await, assuming `db.findUser`, "
    "`db.findOrders` and `db.findAddress` return promises. Keep the same returned object.\n\n"
    f"```javascript\n{_CALLBACKS}\n```",

    "This function has an off-by-one bug: the example prints one average too few. Fix it and "
    "return the whole corrected code, with a comment on the line you changed.\n\n"
    f"```python\n{_MOVING_AVERAGE}\n```",

    "Rename the function and the variables in this C code to descriptive names (it is a binary "
    "search) and add a comment block describing the parameters and the return value. Do not "
    f"change the logic.\n\n```c\n{_C_NAMES}\n```",

    "Rewrite this class as a Python `@dataclass` with typed fields (tags defaults to an empty "
    "list), drop the `get` method in favour of attribute access, and keep a `__repr__` that prints "
    f"the same text.\n\n```python\n{_DICT_CLASS}\n```",

    "Replace every `print` call in this code with the `logging` module at the right level (info, "
    "error, warning), using a module-level logger. Return the full rewritten code.\n\n"
    f"```python\n{_PRINTS}\n```",

    "Rewrite this function to build the report with a list comprehension and `str.join`, using an "
    f"f-string for each line. The output must not change.\n\n```python\n{_STRINGS}\n```",
)

# A 60-line file for whole-file edits (OpenAI's predicted-outputs example: a function renamed).
SHOP_FILE = '''"""Inventory helpers for the shop's back office."""

from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    qty: int


def total_value(items: list[Item]) -> float:
    """The stock's value at list prices."""
    total = 0.0
    for item in items:
        total += item.price * item.qty
    return total


def low_stock(items: list[Item], threshold: int = 5) -> list[str]:
    """Names of the items with fewer than ``threshold`` left."""
    return [item.name for item in items if item.qty < threshold]


def restock(items: list[Item], amount: int) -> None:
    """Add ``amount`` to every item that is low on stock."""
    for item in items:
        if item.qty < 5:
            item.qty += amount


def most_valuable(items: list[Item]) -> Item | None:
    """The item whose stock is worth the most."""
    best = None
    for item in items:
        if best is None or item.price * item.qty > best.price * best.qty:
            best = item
    return best


def price_list(items: list[Item]) -> str:
    """One line per item: name and price, sorted by name."""
    lines = []
    for item in sorted(items, key=lambda i: i.name):
        lines.append(f"{item.name}: {item.price:.2f}")
    return "\\n".join(lines)


def discount(items: list[Item], percent: float) -> None:
    """Lower every price by ``percent``."""
    for item in items:
        item.price = round(item.price * (1 - percent / 100), 2)
'''
_RENAME = ("Rename the function `low_stock` to `items_below_threshold` and update its docstring to match. "
       "Return the whole file and nothing else, in one ```python block.\n\n```python\n" + SHOP_FILE + "```")


FILE_EDIT: tuple[str, ...] = (
    _RENAME,
    "Change the low-stock threshold of `restock` from 5 to 10 and give `restock` a `threshold: int = 10` "
    "parameter used in its comparison. Return the whole file and nothing else, in one ```python block.\n\n"
    "```python\n" + SHOP_FILE + "```",
)
