"""Built-in conversations for the ``agent`` workload: sessions that grow turn by turn.

Coding assistants and agents resend the whole conversation on every call, so each turn's prompt
is the last turn's prompt, the model's answer and a new message: what a prefix cache serves. The
runner sends each user turn after the model's own previous answer (``runner.converse``) and
reports TTFT per turn. The turns are follow-ups, pasted tool output (a traceback, a test run, a
file) among them, as in an agent's loop; the tenth turn of a session stands on about 3000 tokens
at 128 new tokens a turn.
"""

from __future__ import annotations

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
