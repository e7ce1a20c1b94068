"""Built-in conversations for the ``agent`` workload: sessions that grow turn by turn.

Coding assistants and agents resend the whole conversation on every call, so each turn's prompt
is the last turn's prompt, the model's answer and a new message: what a prefix cache serves. The
runner sends each user turn after the model's own previous answer (``runner.converse``) and
reports TTFT per turn. The turns are follow-ups, pasted tool output (a traceback, a test run, a
file) among them, as in an agent's loop; the tenth turn of a session stands on about 3000 tokens
at 128 new tokens a turn.
"""

from __future__ import annotations

from specdecode.bench.prompts_code import SHOP_FILE

_TRACEBACK = '''Traceback (most recent call last):
  File "inventory.py", line 41, in restock
    item = self.items[sku]
KeyError: 'A-1009'
During handling of the above exception, another exception occurred:
  File "inventory.py", line 44, in restock
    raise InventoryError(f"unknown sku {sku}") from exc
inventory.InventoryError: unknown sku A-1009'''

_TEST_RUN = '''$ pytest -q tests/test_inventory.py
..F.F
FAILED tests/test_inventory.py::test_restock_unknown_sku - AssertionError: expected InventoryError
FAILED tests/test_inventory.py::test_low_stock_report - assert ['A-1001'] == ['A-1001', 'A-1004']
2 failed, 3 passed in 0.12s'''

_CONFIG = '''[server]
host = "0.0.0.0"
port = 8080
workers = 4

[database]
url = "postgresql://app@db:5432/app"
pool_size = 10
timeout_s = 5

[cache]
backend = "redis"
url = "redis://cache:6379/0"
ttl_s = 300'''

AGENT: tuple[tuple[str, ...], ...] = (
    (
        "Write a Python class Inventory that keeps items by SKU, each with a name, a quantity and a "
        "reorder level. Give it add_item, remove_item and restock methods.",
        "Add a method low_stock() that returns the SKUs whose quantity is at or below their reorder "
        "level, sorted by SKU.",
        f"Running it I get this traceback:\n\n{_TRACEBACK}\n\nWhat is wrong and how do I fix it?",
        "Now write pytest tests for add_item, restock and low_stock, including the unknown-SKU case.",
        f"Here is the test run:\n\n{_TEST_RUN}\n\nFix the code so both failures pass.",
        "Add type hints everywhere and a docstring to each method.",
        "Make the inventory persist to a JSON file: a save(path) method and a load(path) classmethod.",
        "What happens if two processes save at the same time? Make save safe against that.",
        "Add a command-line interface with argparse: add, remove, restock and report subcommands.",
        "Summarise the final design in a short README section with one usage example per subcommand.",
    ),
    (
        f"Here is our service's config file:\n\n{_CONFIG}\n\nExplain what each section configures.",
        "Write a Python dataclass for this config and a function that loads it with tomllib.",
        "Validate the values: port in 1-65535, workers and pool_size positive, timeouts positive.",
        "Let environment variables override any value, named like APP_DATABASE_POOL_SIZE.",
        "Write tests for the overrides and for each validation error.",
        "Now give me the final loader module in one piece.",
    ),
    (
        "I have a CSV of orders with columns order_id, customer, date, amount, status. Write pandas "
        "code that loads it and prints the total amount per month.",
        "Only count orders whose status is 'paid', and show months with no orders as zero.",
        "Add the number of distinct customers per month next to the totals.",
        "Plot both series on one chart with two y axes and save it as orders.png.",
        "The dates come in two formats, 2024-03-05 and 05/03/2024. Parse both correctly.",
        "Put everything in a function report(path) that returns the table and writes the chart.",
    ),
)

# A coding agent's tool loop (``agent-tools``): each turn hands the model a tool's output (a
# listing, a file, a test run, a diff, a type checker's report) and a short instruction, as an
# agent harness does. Tool output, not the model's answers, makes the conversation grow, by some
# 230 tokens a turn: the tenth turn stands on about 3300 tokens at 128 new tokens a turn.
_LISTING = '''$ ls -R
.:
README.md  pyproject.toml  shop  tests

./shop:
__init__.py  cli.py  inventory.py  pricing.py  storage.py

./tests:
test_inventory.py  test_pricing.py

$ cat README.md
# shop

Back-office helpers for a small shop: stock levels, restocking and price lists.

## Layout
- `shop/inventory.py`: the `Item` dataclass, stock value, low-stock report, restocking.
- `shop/pricing.py`: price lists per customer group, discounts, rounding to cents.
- `shop/storage.py`: stock files (JSON) read and written.
- `shop/cli.py`: the `shop` command (`shop report`, `shop restock`, `shop prices`).

## Development
    python -m venv .venv && . .venv/bin/activate
    pip install -e '.[dev]'
    pytest -q
    mypy shop'''

_TESTS = '''$ cat tests/test_inventory.py
from shop.inventory import Item, low_stock, restock, total_value


def make_items() -> list[Item]:
    return [Item("bolt", 0.25, 100), Item("nut", 0.1, 3), Item("washer", 0.05, 4)]


def test_total_value() -> None:
    assert total_value(make_items()) == 0.25 * 100 + 0.1 * 3 + 0.05 * 4


def test_low_stock_default_threshold() -> None:
    assert low_stock(make_items()) == ["nut", "washer"]


def test_low_stock_threshold() -> None:
    assert low_stock(make_items(), threshold=4) == ["nut"]


def test_restock_adds_to_low_items() -> None:
    items = make_items()
    restock(items, 10)
    assert [item.qty for item in items] == [100, 13, 14]'''

_PYTEST = '''$ pytest -q
....F.F..
____________________________ test_round_cents _____________________________
>       assert round_cents(2.675) == 2.68
E       assert 2.67 == 2.68
tests/test_pricing.py:14: AssertionError
___________________________ test_group_discount ___________________________
>       assert prices["bolt"] == 0.2
E       KeyError: 'bolt'
tests/test_pricing.py:22: KeyError
FAILED tests/test_pricing.py::test_round_cents - assert 2.67 == 2.68
FAILED tests/test_pricing.py::test_group_discount - KeyError: 'bolt'
2 failed, 7 passed in 0.08s'''

_PRICING = '''$ cat shop/pricing.py
"""Price lists per customer group."""

from shop.inventory import Item

DISCOUNTS = {"retail": 0.0, "member": 0.05, "wholesale": 0.2}


def round_cents(amount: float) -> float:
    """The amount rounded to whole cents."""
    return round(amount, 2)


def price_list(items: list[Item], group: str = "retail") -> dict[str, float]:
    """Each item's price for ``group``, by item name."""
    discount = DISCOUNTS[group]
    return {item.name.upper(): round_cents(item.price * (1 - discount)) for item in items}'''

_DIFF = '''$ git diff
diff --git a/shop/pricing.py b/shop/pricing.py
--- a/shop/pricing.py
+++ b/shop/pricing.py
@@ -1,5 +1,7 @@
 """Price lists per customer group."""

+from decimal import ROUND_HALF_UP, Decimal
+
 from shop.inventory import Item

 DISCOUNTS = {"retail": 0.0, "member": 0.05, "wholesale": 0.2}
@@ -7,12 +9,12 @@ DISCOUNTS = {"retail": 0.0, "member": 0.05, "wholesale": 0.2}

 def round_cents(amount: float) -> float:
     """The amount rounded to whole cents."""
-    return round(amount, 2)
+    return float(Decimal(str(amount)).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP))


 def price_list(items: list[Item], group: str = "retail") -> dict[str, float]:
     """Each item's price for ``group``, by item name."""
     discount = DISCOUNTS[group]
-    return {item.name.upper(): round_cents(item.price * (1 - discount)) for item in items}
+    return {item.name: round_cents(item.price * (1 - discount)) for item in items}'''

_GREP = '''$ grep -rn "price_list" --include=*.py .
./shop/pricing.py:15:def price_list(items: list[Item], group: str = "retail") -> dict[str, float]:
./shop/pricing.py:23:    prices = price_list(items, group)
./shop/cli.py:7:from shop.pricing import DISCOUNTS, price_list
./shop/cli.py:24:        for name, price in sorted(price_list(items, group).items()):
./tests/test_pricing.py:20:    prices = price_list(make_items(), group="wholesale")'''

_CLI = '''$ cat shop/cli.py
"""The ``shop`` command."""

import argparse
from pathlib import Path

from shop.inventory import low_stock, restock, total_value
from shop.pricing import DISCOUNTS, price_list
from shop.storage import load, save


def main() -> None:
    parser = argparse.ArgumentParser(prog="shop")
    parser.add_argument("stock", type=Path)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("report")
    restock_cmd = sub.add_parser("restock")
    restock_cmd.add_argument("amount", type=int)
    prices_cmd = sub.add_parser("prices")
    prices_cmd.add_argument("--group", default="retail")
    args = parser.parse_args()
    items = load(args.stock)
    if args.command == "prices":
        group = args.group if args.group in DISCOUNTS else "retail"
        for name, price in sorted(price_list(items, group).items()):
            print(f"{name:20s} {price:8.2f}")
    elif args.command == "restock":
        restock(items, args.amount)
        save(args.stock, items)
    else:
        print(f"stock value {total_value(items):.2f}; low: {', '.join(low_stock(items)) or 'none'}")'''

_MYPY = '''$ mypy shop
shop/storage.py:9: error: Returning Any from function declared to return "list[Item]"  [no-any-return]
shop/cli.py:24: error: Argument 2 to "price_list" has incompatible type "str | Any"; expected "str"  [arg-type]
shop/inventory.py:35: error: Need type annotation for "best"  [var-annotated]
Found 3 errors in 3 files (checked 5 source files)'''

_PYTEST_AFTER = '''$ pytest -q
.........F.
=================================== FAILURES ===================================
___________________________ test_prices_command ______________________________

    def test_prices_command(capsys, tmp_path) -> None:
        stock = tmp_path / "stock.json"
        stock.write_text('[{"name": "bolt", "price": 0.25, "qty": 100}]')
        run(["shop", str(stock), "prices", "--group", "vip"])
>       assert "unknown group" in capsys.readouterr().err
E       AssertionError: assert 'unknown group' in ''

tests/test_cli.py:18: AssertionError
FAILED tests/test_cli.py::test_prices_command - AssertionError: assert 'unknown group' in ''
1 failed, 10 passed in 0.11s'''

AGENT_TOOLS: tuple[tuple[str, ...], ...] = (
    (
        f"You are a coding agent in the repository below. Tool output:\n\n{_LISTING}\n\nWhich files would "
        "you read first to fix a pricing bug, and why? Answer briefly.",
        "Tool output:\n\n$ cat shop/inventory.py\n" + SHOP_FILE + "\nSummarise what this module provides, "
        "one line per function.",
        f"Tool output:\n\n{_TESTS}\n\nWhich behaviours of shop/inventory.py do these tests not cover?",
        f"Tool output:\n\n{_PYTEST}\n\nWhat is the likely cause of each failure?",
        f"Tool output:\n\n{_PRICING}\n\nPropose the smallest change to shop/pricing.py that fixes both "
        "failures.",
        f"Tool output:\n\n{_DIFF}\n\nReview this diff: does it fix both failures, and does it break anything?",
        f"Tool output:\n\n{_GREP}\n\nWhich callers depend on the upper-case names the old code returned?",
        f"Tool output:\n\n{_CLI}\n\nThe prices command silently falls back to retail for an unknown group. "
        "Change it to print an error to stderr and exit with status 2.",
        f"Tool output:\n\n{_PYTEST_AFTER}\n\nWhy does this test still fail with your change? Give the fix.",
        f"Tool output:\n\n{_MYPY}\n\nFix each of these type errors; show only the changed lines.",
    ),
)
