"""The soak's traffic: a seeded schedule of mixed requests, and what each one got.

Each client draws its requests from its own seeded generator: chat and completions (streamed or
not), streams it cuts after a few chunks, clients that hang up before the answer, n > 1, structured
output, OpenAI predictions (drafts for speculative decoding), long shared prefixes, multi-turn
conversations, and bad input (a prompt over the context, malformed JSON, an unknown model). A burst
task sends more requests at once than `--max-queue` admits. Every request becomes an `Outcome`
(its kind, target, start and end, status, what came back), classified after the run against the
fault windows (soak.py).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

MODEL = "SmolLM2-135M-Instruct"
SYSTEMS = [f"You are the archivist of the {place} library. " + f"The {place} library keeps maps, letters and "
           f"ledgers of the {place} merchants, sorted by year and by family. " * 14
           for place in ("Lisbon", "Antwerp", "Genoa", "Lubeck")]
QUESTIONS = ["Which year has the most letters?", "Name one family.", "What is kept in the ledgers?",
             "Summarize the maps.", "Who sorted the archive?", "Write a short title for the collection."]
SCHEMA = {"type": "object", "properties": {"year": {"type": "integer"}, "family": {"type": "string"}},
          "required": ["year", "family"]}
# kind -> weight in the schedule; "bad-*" expect a 4xx, "cut" and "hangup" end early on purpose
KINDS = {"chat": 4, "completion": 3, "conversation": 4, "cut": 2, "hangup": 1, "n2": 1, "json": 1,
         "prediction": 1, "bad-oversized": 0.3, "bad-json": 0.3, "bad-model": 0.3}
EXPECTED_4XX = {"bad-oversized": 400, "bad-json": 400, "bad-model": 404}


@dataclass
class Outcome:
    kind: str
    target: str                        # "fleet" or "pd"
    start: float                       # wall-clock seconds (matched against the routers' logs)
    end: float = 0.0
    status: int | None = None          # HTTP status; None: no response (transport error, or we hung up)
    error: str = ""                    # the error's message or type
    text: str = ""


@dataclass
class Traffic:
    """Clients sending the seeded schedule to the routers until `stop` is set."""

    routes: dict[str, str]             # "fleet"/"pd" -> router URL
    seed: int
    outcomes: list[Outcome] = field(default_factory=list)
    bursts_at: list[tuple[float, float]] = field(default_factory=list)     # (start, end) of each burst
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def client(self, index: int, target: str) -> None:
        rng = random.Random(f"{self.seed}-{index}")
        history: list[dict] = []
        kinds, weights = list(KINDS), list(KINDS.values())
        async with httpx.AsyncClient(base_url=self.routes[target], timeout=120) as http:
            while not self.stop.is_set():
                kind = rng.choices(kinds, weights)[0]
                outcome = Outcome(kind, target, time.time())
                if kind == "conversation":
                    history = history if history and len(history) < 8 else new_conversation(rng)
                    history.append({"role": "user", "content": rng.choice(QUESTIONS)})
                await send(http, rng, kind, history, outcome)
                if kind == "conversation":
                    history.append({"role": "assistant", "content": outcome.text or "..."})
                outcome.end = time.time()
                self.outcomes.append(outcome)
                if outcome.status is None and outcome.error != "hung up" or (outcome.status or 0) >= 500:
                    await asyncio.sleep(1.0)     # as a client that retries does: no hot loop against an outage

    async def bursts(self, every_s: float, size: int) -> None:
        """Every `every_s`, `size` short requests at once at the fleet: past `--max-queue`, 503s."""
        rng = random.Random(f"{self.seed}-burst")
        async with httpx.AsyncClient(base_url=self.routes["fleet"], timeout=120) as http:
            while not self.stop.is_set():
                try:
                    await asyncio.wait_for(self.stop.wait(), every_s)
                except asyncio.TimeoutError:
                    outcomes = [Outcome("burst", "fleet", time.time()) for _ in range(size)]
                    await asyncio.gather(*(send(http, rng, "completion", [], o) for o in outcomes))
                    for outcome in outcomes:
                        outcome.end = time.time()
                    self.bursts_at.append((outcomes[0].start, outcomes[0].end))
                    self.outcomes.extend(outcomes)


def new_conversation(rng: random.Random) -> list[dict]:
    return [{"role": "system", "content": rng.choice(SYSTEMS)}]


def body_for(rng: random.Random, kind: str, history: list[dict]) -> dict:
    system = rng.choice(SYSTEMS)
    chat = [{"role": "system", "content": system}, {"role": "user", "content": rng.choice(QUESTIONS)}]
    prompt = system + rng.choice(QUESTIONS)
    tokens = rng.randrange(4, 32)
    bodies = {
        "chat": dict(messages=chat, max_tokens=tokens, temperature=0, stream=rng.random() < 0.5),
        "completion": dict(prompt=prompt, max_tokens=tokens, temperature=0, stream=rng.random() < 0.5),
        "conversation": dict(messages=history, max_tokens=tokens, temperature=0.7, seed=rng.randrange(1000),
                             stream=True),
        "cut": dict(prompt=prompt, max_tokens=64, temperature=0, stream=True),
        "hangup": dict(prompt=prompt, max_tokens=64, temperature=0),
        "n2": dict(prompt=prompt, max_tokens=tokens, temperature=0.8, n=2, seed=rng.randrange(1000)),
        "json": dict(messages=chat, max_tokens=48, temperature=0,
                     response_format={"type": "json_schema", "json_schema": {"name": "entry", "schema": SCHEMA}}),
        "prediction": dict(messages=chat, max_tokens=tokens, temperature=0,
                           prediction={"type": "content", "content": system[:200]}),
        "bad-oversized": dict(prompt="ledger " * 6000, max_tokens=8),
        "bad-model": dict(prompt=prompt, max_tokens=8, model="no-such-model"),
    }
    return {"model": MODEL, **bodies[kind]} if kind in bodies else {}


async def send(http: httpx.AsyncClient, rng: random.Random, kind: str, history: list[dict], outcome: Outcome) -> None:
    """One request of `kind`; fills `outcome` (status, error, text). Never raises for what the server does."""
    body = body_for(rng, kind, history)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    try:
        if kind == "bad-json":
            response = await http.post("/v1/completions", content=b'{"model": "x", "prompt": ',
                                       headers={"content-type": "application/json"})
            outcome.status, outcome.error = response.status_code, response.text[:200]
        elif kind == "hangup":
            await asyncio.wait_for(http.post(path, json=body), timeout=rng.uniform(0.05, 0.5))
            outcome.status = 200
        elif body.get("stream"):
            await stream(http, path, body, outcome, cut_after=rng.randrange(1, 6) if kind == "cut" else None)
        else:
            response = await http.post(path, json=body)
            outcome.status = response.status_code
            if response.status_code == 200:
                outcome.text = "".join(c.get("text") or c.get("message", {}).get("content") or ""
                                       for c in response.json()["choices"])
            else:
                outcome.error = response.text[:200]
    except asyncio.TimeoutError:
        outcome.error = "hung up"
    except httpx.HTTPError as exc:
        outcome.error = f"transport: {type(exc).__name__}"


async def stream(http: httpx.AsyncClient, path: str, body: dict, outcome: Outcome, cut_after: int | None) -> None:
    """Read a stream to its end, or close it after `cut_after` chunks; an error event sets `outcome.error`."""
    async with http.stream("POST", path, json=body) as response:
        outcome.status = response.status_code
        if response.status_code != 200:
            outcome.error = (await response.aread()).decode(errors="replace")[:200]
            return
        chunks = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                outcome.error = f"stream error: {event['error'].get('message', '')[:160]}"
                return
            for choice in event.get("choices", []):
                outcome.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            chunks += 1
            if cut_after is not None and chunks >= cut_after:
                outcome.error = "cut"
                return
