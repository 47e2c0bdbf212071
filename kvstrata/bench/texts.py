"""The text the input-grounded workloads are made of: small source files and prose passages, written
for this benchmark and shipped with it, so every run on any machine sends the same prompts.

Each source file names identifiers a rename task may pick (`renames`: old -> new); each passage
names the sentences a summary should quote. Kept small on purpose: a prompt of a few hundred tokens
is what an editor or a chat client sends when it asks for a file back.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SourceFile:
    name: str
    language: str
    text: str
    renames: tuple[tuple[str, str], ...]     # (identifier in the text, what to call it instead)


@dataclass(frozen=True)
class Passage:
    title: str
    text: str


SOURCES: tuple[SourceFile, ...] = (
    SourceFile("inventory.py", "python", '''\
from dataclasses import dataclass, field


@dataclass
class Item:
    sku: str
    name: str
    quantity: int = 0
    price: float = 0.0


@dataclass
class Inventory:
    items: dict[str, Item] = field(default_factory=dict)

    def add_item(self, sku: str, name: str, quantity: int, price: float) -> Item:
        if sku in self.items:
            item = self.items[sku]
            item.quantity += quantity
            item.price = price
            return item
        item = Item(sku, name, quantity, price)
        self.items[sku] = item
        return item

    def remove_item(self, sku: str, quantity: int) -> bool:
        item = self.items.get(sku)
        if item is None or item.quantity < quantity:
            return False
        item.quantity -= quantity
        if item.quantity == 0:
            del self.items[sku]
        return True

    def total_value(self) -> float:
        return sum(item.quantity * item.price for item in self.items.values())

    def low_stock(self, threshold: int = 5) -> list[Item]:
        return [item for item in self.items.values() if item.quantity < threshold]


def load_inventory(rows: list[tuple[str, str, int, float]]) -> Inventory:
    inventory = Inventory()
    for sku, name, quantity, price in rows:
        inventory.add_item(sku, name, quantity, price)
    return inventory
''', (("Inventory", "Stock"), ("add_item", "put_item"), ("total_value", "stock_value"), ("low_stock", "running_low"),
      ("load_inventory", "read_inventory"), ("quantity", "count"))),
    SourceFile("text_stats.py", "python", '''\
import re
from collections import Counter

WORD = re.compile(r"[A-Za-z']+")


def words(text: str) -> list[str]:
    """Lower-cased words of a text, apostrophes kept."""
    return [match.group(0).lower() for match in WORD.finditer(text)]


def word_counts(text: str) -> Counter:
    return Counter(words(text))


def most_common_words(text: str, count: int = 10) -> list[tuple[str, int]]:
    return word_counts(text).most_common(count)


def sentence_lengths(text: str) -> list[int]:
    sentences = [part.strip() for part in re.split(r"[.!?]+", text) if part.strip()]
    return [len(words(sentence)) for sentence in sentences]


def average_sentence_length(text: str) -> float:
    lengths = sentence_lengths(text)
    if not lengths:
        return 0.0
    return sum(lengths) / len(lengths)


def summary(text: str) -> dict:
    counts = word_counts(text)
    return {
        "words": sum(counts.values()),
        "distinct_words": len(counts),
        "average_sentence_length": average_sentence_length(text),
        "most_common": most_common_words(text, 5),
    }


if __name__ == "__main__":
    import sys

    report = summary(sys.stdin.read())
    for key, value in report.items():
        print(f"{key}: {value}")
''', (("words", "tokens"), ("word_counts", "count_words"), ("sentence_lengths", "sentence_sizes"),
      ("summary", "describe"), ("report", "result"), ("WORD", "WORD_PATTERN"))),
    SourceFile("rate_limiter.py", "python", '''\
import threading
import time


class TokenBucket:
    """Allows `rate` events per second on average, with bursts of up to `capacity`."""

    def __init__(self, rate: float, capacity: int):
        if rate <= 0 or capacity <= 0:
            raise ValueError("rate and capacity must be positive")
        self.rate = rate
        self.capacity = capacity
        self.tokens = float(capacity)
        self.updated = time.monotonic()
        self.lock = threading.Lock()

    def _refill(self) -> None:
        now = time.monotonic()
        elapsed = now - self.updated
        self.tokens = min(self.capacity, self.tokens + elapsed * self.rate)
        self.updated = now

    def try_acquire(self, amount: int = 1) -> bool:
        with self.lock:
            self._refill()
            if self.tokens >= amount:
                self.tokens -= amount
                return True
            return False

    def wait_time(self, amount: int = 1) -> float:
        with self.lock:
            self._refill()
            missing = amount - self.tokens
            return max(0.0, missing / self.rate)

    def acquire(self, amount: int = 1) -> None:
        while not self.try_acquire(amount):
            time.sleep(self.wait_time(amount))


class RateLimiter:
    def __init__(self, rate: float, capacity: int):
        self.rate = rate
        self.capacity = capacity
        self.buckets: dict[str, TokenBucket] = {}

    def allow(self, key: str) -> bool:
        bucket = self.buckets.setdefault(key, TokenBucket(self.rate, self.capacity))
        return bucket.try_acquire()
''', (("TokenBucket", "Allowance"), ("try_acquire", "take"), ("wait_time", "delay_for"), ("RateLimiter", "Throttle"),
      ("tokens", "level"), ("buckets", "by_key"))),
    SourceFile("graph.py", "python", '''\
from collections import deque


class Graph:
    def __init__(self):
        self.edges: dict[str, set[str]] = {}

    def add_edge(self, source: str, target: str) -> None:
        self.edges.setdefault(source, set()).add(target)
        self.edges.setdefault(target, set())

    def neighbours(self, node: str) -> set[str]:
        return self.edges.get(node, set())

    def shortest_path(self, start: str, goal: str) -> list[str] | None:
        previous: dict[str, str | None] = {start: None}
        queue = deque([start])
        while queue:
            node = queue.popleft()
            if node == goal:
                path = []
                while node is not None:
                    path.append(node)
                    node = previous[node]
                return path[::-1]
            for neighbour in sorted(self.neighbours(node)):
                if neighbour not in previous:
                    previous[neighbour] = node
                    queue.append(neighbour)
        return None

    def topological_order(self) -> list[str]:
        incoming = {node: 0 for node in self.edges}
        for targets in self.edges.values():
            for target in targets:
                incoming[target] += 1
        ready = deque(sorted(node for node, count in incoming.items() if count == 0))
        order = []
        while ready:
            node = ready.popleft()
            order.append(node)
            for target in sorted(self.edges[node]):
                incoming[target] -= 1
                if incoming[target] == 0:
                    ready.append(target)
        if len(order) != len(self.edges):
            raise ValueError("the graph has a cycle")
        return order
''', (("Graph", "DirectedGraph"), ("add_edge", "connect"), ("neighbours", "successors"),
      ("shortest_path", "find_path"), ("topological_order", "build_order"), ("incoming", "in_degree"))),
    SourceFile("cart.js", "javascript", '''\
class Cart {
  constructor(taxRate) {
    this.taxRate = taxRate;
    this.lines = [];
  }

  addLine(product, quantity) {
    const existing = this.lines.find((line) => line.product.id === product.id);
    if (existing) {
      existing.quantity += quantity;
    } else {
      this.lines.push({ product, quantity });
    }
  }

  removeLine(productId) {
    this.lines = this.lines.filter((line) => line.product.id !== productId);
  }

  subtotal() {
    return this.lines.reduce((sum, line) => sum + line.product.price * line.quantity, 0);
  }

  tax() {
    return Math.round(this.subtotal() * this.taxRate * 100) / 100;
  }

  total() {
    return this.subtotal() + this.tax();
  }

  summary() {
    return this.lines.map((line) => `${line.quantity} x ${line.product.name}`).join("\\n");
  }
}

function applyDiscount(cart, percent) {
  for (const line of cart.lines) {
    line.product = { ...line.product, price: line.product.price * (1 - percent / 100) };
  }
  return cart;
}

module.exports = { Cart, applyDiscount };
''', (("Cart", "Basket"), ("addLine", "appendLine"), ("removeLine", "dropLine"), ("subtotal", "netTotal"),
      ("applyDiscount", "discountAll"), ("taxRate", "vatRate"))),
    SourceFile("config_loader.py", "python", '''\
import json
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8080
    workers: int = 4
    debug: bool = False
    log_file: str | None = None


def from_file(path: Path) -> dict:
    if not path.exists():
        return {}
    with path.open() as handle:
        return json.load(handle)


def from_environment(prefix: str = "APP_") -> dict:
    values = {}
    for key, value in os.environ.items():
        if key.startswith(prefix):
            values[key[len(prefix):].lower()] = value
    return values


def parse_value(name: str, value):
    if name in ("port", "workers"):
        return int(value)
    if name == "debug":
        return str(value).lower() in ("1", "true", "yes")
    return value


def load_settings(path: Path, prefix: str = "APP_") -> Settings:
    merged = {**from_file(path), **from_environment(prefix)}
    known = Settings.__dataclass_fields__
    unknown = sorted(set(merged) - set(known))
    if unknown:
        raise ValueError(f"unknown settings: {', '.join(unknown)}")
    return Settings(**{name: parse_value(name, value) for name, value in merged.items()})
''', (("Settings", "Options"), ("from_file", "read_file"), ("from_environment", "read_environment"),
      ("parse_value", "convert"), ("load_settings", "settings_for"), ("merged", "combined"))),
)


PASSAGES: tuple[Passage, ...] = (
    Passage("The lighthouse", """\
The lighthouse on the northern cape was built in 1874, after three ships were lost on the reef in a \
single winter. Its first keeper, Thomas Harlow, kept a log of every vessel that passed, and that log \
survives today in the town museum. "The light is not for the ships we see," he wrote in the first \
pages, "but for the ones we never will." For nearly a century the lamp burned oil, and the keepers \
carried it up one hundred and twelve steps each evening. In 1961 the light was electrified, and in \
1989 the last keeper left when the station became automatic. The building fell into disrepair until a \
group of volunteers restored it in 2004. They repaired the lantern room, replaced the rotting stairs, \
and opened the tower to visitors in the summer months. Today the light still turns every night, \
although modern ships rarely need it. The volunteers say the visitors come for the view, but stay for \
the stories of the keepers and the ships they watched over."""),
    Passage("Urban gardens", """\
Over the last decade, city councils across the region have turned empty lots into community gardens. \
The programme began in 2013 with four plots on disused railway land, and it now counts more than two \
hundred gardens tended by about six thousand residents. A survey published last spring found that \
gardeners ate more fresh vegetables and reported feeling less isolated than their neighbours. "People \
come for the tomatoes and stay for the conversation," one organiser told the council. The gardens \
have critics as well. Some developers argue that the land would be better used for housing, and the \
council has twice delayed a vote on making the plots permanent. Supporters answer that the gardens \
cost the city almost nothing to run, because the volunteers provide the labour and the seeds are \
donated by local shops. The council is expected to decide the matter before the end of the year, \
after a public consultation that has already received more than four thousand responses."""),
    Passage("The night train", """\
The night train from the capital to the coast was cancelled in 2009, when cheap flights made it \
hard to fill the sleeping cars. Last year the rail company brought it back, and to its own surprise \
the service has been full on most nights. The new carriages have private cabins, a small dining car \
and windows that open. Passengers interviewed on the platform gave many reasons for choosing the \
train. Some wanted to avoid flying for the sake of the climate, while others simply liked waking up \
by the sea. "You lose a night in a hotel and gain a morning," said one regular traveller. The company \
now plans a second route to the mountains, which it hopes to open within two years. Critics point out \
that the tickets cost more than a flight and that the subsidy from the government is large. The \
company replies that the numbers will improve as more carriages are added and the trains run every \
night of the week."""),
)


CHAT_QUESTIONS: tuple[str, ...] = (
    "Write a short story about a fox who learns to play the violin.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me five ideas for a rainy weekend with friends, with a sentence on each.",
    "What are the pros and cons of working from home?",
    "Describe a walk through a busy market in the morning.",
    "How does a bicycle stay upright when it moves?",
    "Write a letter to a neighbour asking to borrow a ladder.",
    "What should I think about before adopting a dog?",
    "Invent a new sport and explain its rules.",
    "Why do people enjoy scary films?",
    "Plan a three-day trip to a city by the sea.",
    "Write a poem about the first snow of winter.",
)
