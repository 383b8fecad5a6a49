"""A labeled corpus of near-duplicate loops and of the progress that looks like them (issue 29),
written by code: each case is a run of spans, in two instrumentation styles (GenAI JSON
arguments and results; OpenInference with smolagents-style kwargs and text results), with
its label. tests/unit/detectors/test_near_duplicates.py scores loopwatch on it.

Loops:  rephrased searches whose results are mostly pages already listed (JSON lists, and
        markdown text with links); a page walked again over viewports already seen; a find
        tool rephrased over the same viewport; a code-writing agent whose model turns write
        nearly the same code and read the same execution output; rephrased questions
        answered by the same article under a changing header.
Progress: pagination with new items; polling whose state advances; fan-out in one turn
        (overlapping and back to back); a page walked forward over new content; rephrased
        searches whose results are new; a code agent whose code and output move on;
        rephrased questions answered by new articles of one template; different pages of
        one site (their URLs share words, their views the site's navigation links);
        unrelated searches.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from streams.spanpath.spans import STATUS_UNSET, SpanRecord
from tests.spankit import MS, Run

QUALIFIERS = ("latest", "official", "2023", "2024", "list", "history", "wikipedia", "exact")


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("bcdfgklmnprstvz") + rng.choice("aeiou") for _ in range(3))


def _text(rng: random.Random, words: int) -> str:
    return " ".join(_word(rng) for _ in range(words)) + "."


STOPWORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "for",
    "on",
    "with",
    "as",
    "by",
    "at",
    "from",
    "that",
    "this",
    "it",
    "are",
    "was",
    "be",
    "or",
    "an",
    "not",
    "which",
    "have",
    "has",
    "but",
    "all",
    "can",
    "more",
    "one",
    "about",
    "their",
    "also",
]


def _prose(rng: random.Random, words: int) -> str:
    """Text that shares its common words with any other text, as prose does."""
    return " ".join(
        rng.choice(STOPWORDS) if rng.random() < 0.45 else _word(rng) for _ in range(words)
    )


def _page(rng: random.Random) -> dict[str, str]:
    slug = f"{_word(rng)}/{_word(rng)}-{rng.randrange(10**6)}"
    return {"url": f"https://{_word(rng)}.example/{slug}", "title": _text(rng, 5)}


def _rephrase(rng: random.Random, base: list[str]) -> str:
    words = list(base)
    rng.shuffle(words)
    if rng.random() < 0.5:
        words.append(rng.choice(QUALIFIERS))
    if len(words) > 4 and rng.random() < 0.4:
        words.pop(rng.randrange(len(words)))
    return " ".join(words)


@dataclass
class Case:
    name: str
    loop: bool
    spans: list[SpanRecord]
    agent: Agent


class Agent:
    """One run in one instrumentation style."""

    def __init__(self, trace: int, style: str) -> None:
        self.run = Run(trace=trace)
        self.style = style
        # what the span path reads of each call (name, arguments, result) and model turn
        # (output, last input message): the sketches' error is measured on them
        self.calls: list[tuple[str, dict[str, Any], Any]] = []
        self.turns: list[tuple[str, str]] = []

    def turn(self, calls: list[tuple[str, Any]]) -> None:
        self.run.llm(tool_calls=calls)

    def tool(self, name: str, args: dict[str, Any], result: Any, **kw: Any) -> None:
        if self.style == "genai":
            self.run.tool(name, args, result, **kw)
            self.calls.append((name, args, result))
            return
        # OpenInference (smolagents): kwargs envelope, results as text
        if isinstance(result, str):
            text = result
        elif isinstance(result, list):
            text = _markdown(result)
        else:
            text = json.dumps(result)
        self.calls.append((name, args, text))
        run = self.run
        run.clock += kw.get("gap_ms", 20) * MS if not kw.get("parallel") else 0
        start = run.clock
        end = start + kw.get("dur_ms", 100) * MS
        if not kw.get("parallel"):
            run.clock = end
        run.spans.append(
            SpanRecord(
                run.trace_id,
                run._next(),
                run.root_id,
                name,
                1,
                start,
                end,
                STATUS_UNSET,
                "",
                {
                    "openinference.span.kind": "TOOL",
                    "tool.name": name,
                    "input.value": json.dumps(
                        {"args": [], "sanitize_inputs_outputs": True, "kwargs": args}
                    ),
                    "output.value": text,
                },
                run.resource,
            )
        )

    def code_turn(self, observation: str, code: str) -> None:
        """A code agent's model turn: reads the last observation, writes code."""
        self.turns.append((code, observation))
        history = [
            {"role": "system", "content": "You are an agent that writes python."},
            {"role": "user", "content": observation},
        ]
        if self.style == "genai":
            attrs = {
                "gen_ai.operation.name": "chat",
                "gen_ai.input.messages": json.dumps(history),
                "gen_ai.output.messages": json.dumps(
                    [{"role": "assistant", "parts": [{"type": "text", "content": code}]}]
                ),
            }
        else:
            attrs = {"openinference.span.kind": "LLM"}
            for i, message in enumerate(history):
                attrs[f"llm.input_messages.{i}.message.role"] = message["role"]
                attrs[f"llm.input_messages.{i}.message.content"] = message["content"]
            attrs["llm.output_messages.0.message.content"] = code
        self.run.other("chat model", attrs, dur_ms=400)

    def done(self) -> list[SpanRecord]:
        self.run.root()
        return self.run.spans


def _markdown(pages: list[dict[str, str]]) -> str:
    lines = ["## Search Results"]
    for i, p in enumerate(pages):
        lines.append(f"{i}. [{p['title']}]({p['url']})\n{p['title'].upper()} snippet.")
    return "\n\n".join(lines)


def _results(rng: random.Random, pool: list[dict[str, str]], n: int, seen: float) -> Any:
    """n results of which about `seen` are pages already in the pool (which grows)."""
    out = []
    for _ in range(n):
        if pool and rng.random() < seen:
            out.append(rng.choice(pool))
        else:
            page = _page(rng)
            pool.append(page)
            out.append(page)
    return out


# ------------------------------------------------------------------------------ loops


def _rephrased_searches(rng: random.Random, a: Agent, seen: Callable[[int], float]) -> None:
    """3 to 6 rephrasings of one query; search i lists pages `seen(i)` of them seen before."""
    base = [_word(rng) for _ in range(rng.randint(3, 5))]
    pool: list[dict[str, str]] = []
    for i in range(rng.randint(3, 6)):
        query = _rephrase(rng, base)
        a.turn([("web_search", {"query": query})])
        a.tool("web_search", {"query": query}, _results(rng, pool, 8, seen(i)))


def rephrased_search(rng: random.Random, a: Agent) -> None:
    """Each search after the first lists mostly pages already listed."""
    _rephrased_searches(rng, a, lambda i: 0.0 if i == 0 else rng.uniform(0.8, 1.0))


def page_walked_again(rng: random.Random, a: Agent) -> None:
    url = _page(rng)["url"]
    views = [f"Address: {url}\nViewport {i + 1} of 9\n{_prose(rng, 120)}" for i in range(3)]
    for _ in range(2):
        a.turn([("visit_page", {"url": url})])
        a.tool("visit_page", {"url": url}, views[0])
        for view in views[1:]:
            a.turn([("page_down", {})])
            a.tool("page_down", {}, view)


def find_rephrased(rng: random.Random, a: Agent) -> None:
    url = _page(rng)["url"]
    phrase = [_word(rng) for _ in range(3)]
    view = f"Address: {url}\nViewport 4 of 9\n{_text(rng, 150)}"
    a.turn([("visit_page", {"url": url})])
    a.tool("visit_page", {"url": url}, f"Address: {url}\nViewport 1 of 9\n{_text(rng, 150)}")
    for _ in range(rng.randint(3, 5)):
        search = _rephrase(rng, phrase)
        a.turn([("find_on_page", {"search_string": search})])
        a.tool("find_on_page", {"search_string": search}, view)


def code_agent_repeating(rng: random.Random, a: Agent) -> None:
    task = f"Task: compute the {_word(rng)} of {_word(rng)}.csv"
    code = f"import pandas as pd\ndf = pd.read_csv('{_word(rng)}.csv')\nprint(df['{_word(rng)}'])"
    error = f"Execution logs:\nKeyError: '{_word(rng)}' in {_word(rng)} line {rng.randint(2, 9)}"
    observation = task
    for i in range(rng.randint(3, 5)):
        variant = code if i % 2 == 0 else code.replace("df", "frame")
        a.code_turn(observation, variant + f"\n# attempt {i}")
        observation = error
    a.code_turn(observation, "final_answer('not found')")
    a.tool("final_answer", {"answer": "not found"}, "not found")


def _kb_questions(rng: random.Random, a: Agent, article: Callable[[], str]) -> None:
    """Rephrased questions to a knowledge-base tool; each answer a header (rank, time)
    and `article()`."""
    base = [_word(rng) for _ in range(rng.randint(3, 5))]
    for i in range(rng.randint(3, 5)):
        query = _rephrase(rng, base)
        a.turn([("search_kb", {"question": query})])
        header = f"Best match (score 0.{rng.randint(50, 99)}), retrieved 10:{i:02d}:{rng.randint(10, 59)}"
        a.tool("search_kb", {"question": query}, {"answer": f"{header}\n{article()}"})


def answer_rephrased(rng: random.Random, a: Agent) -> None:
    """The same article every time: only the answer's header changes."""
    body = _prose(rng, 80)
    _kb_questions(rng, a, lambda: body)


# ------------------------------------------------------------------------------ progress


def pagination(rng: random.Random, a: Agent) -> None:
    query = " ".join(_word(rng) for _ in range(3))
    pool: list[dict[str, str]] = []
    for page in range(1, rng.randint(4, 7)):
        a.turn([("search_docs", {"query": query, "page": page})])
        a.tool("search_docs", {"query": query, "page": page}, _results(rng, pool, 10, 0.0))


def polling(rng: random.Random, a: Agent) -> None:
    job = f"job-{rng.randrange(10**6)}"
    steps = rng.randint(4, 7)
    for i in range(steps):
        state = "done" if i == steps - 1 else "running"
        a.turn([("get_job", {"job_id": job})])
        a.tool("get_job", {"job_id": job}, {"job": job, "state": state, "progress": 15 * i})


def fan_out(rng: random.Random, a: Agent) -> None:
    base = [_word(rng) for _ in range(4)]
    queries = [_rephrase(rng, base) for _ in range(rng.randint(3, 4))]
    pool: list[dict[str, str]] = []
    a.turn([("web_search", {"query": q}) for q in queries])
    overlapping = rng.random() < 0.5
    for i, q in enumerate(queries):
        pages = _results(rng, pool, 8, 0.0 if i == 0 else 0.9)
        a.tool("web_search", {"query": q}, pages, parallel=overlapping)
    a.turn([("answer", {})])


def page_forward(rng: random.Random, a: Agent) -> None:
    url = _page(rng)["url"]
    a.turn([("visit_page", {"url": url})])
    a.tool("visit_page", {"url": url}, f"Address: {url}\nViewport 1 of 9\n{_text(rng, 120)}")
    for i in range(rng.randint(3, 6)):
        a.turn([("page_down", {})])
        a.tool("page_down", {}, f"Address: {url}\nViewport {i + 2} of 9\n{_prose(rng, 120)}")


def new_results(rng: random.Random, a: Agent) -> None:
    """Every search lists mostly new pages."""
    _rephrased_searches(rng, a, lambda i: rng.uniform(0.0, 0.3))


def code_agent_progressing(rng: random.Random, a: Agent) -> None:
    observation = f"Task: summarize {_word(rng)}.csv"
    for i in range(rng.randint(3, 6)):
        code = f"step_{i} = {_word(rng)}({_word(rng)}, '{_word(rng)}')\nprint(step_{i})"
        a.code_turn(observation, code)
        observation = f"Execution logs:\n{_prose(rng, 20)}"
    a.code_turn(observation, "final_answer(result)")
    a.tool("final_answer", {"answer": "42"}, "42")


def answers_move_on(rng: random.Random, a: Agent) -> None:
    """Rephrased questions answered by different articles of one template."""
    _kb_questions(rng, a, lambda: _prose(rng, 80))


def site_pages(rng: random.Random, a: Agent) -> None:
    """Different pages of one site: their URLs share most words, their views share the
    site's navigation links, their content is new."""
    site = f"https://{_word(rng)}.example/wiki/"
    nav = [f"[{_word(rng)}]({site}{_word(rng)})" for _ in range(8)]
    for _ in range(rng.randint(3, 5)):
        url = site + "_".join(_word(rng) for _ in range(2))
        links = [f"[{_word(rng)}]({site}{_word(rng)})" for _ in range(3)]
        view = f"Address: {url}\n{' '.join(nav)}\n{_prose(rng, 100)} {' '.join(links)}"
        a.turn([("visit_page", {"url": url})])
        a.tool("visit_page", {"url": url}, view)


def unrelated_searches(rng: random.Random, a: Agent) -> None:
    pool: list[dict[str, str]] = []
    for _ in range(rng.randint(3, 6)):
        query = " ".join(_word(rng) for _ in range(4))
        a.turn([("web_search", {"query": query})])
        a.tool("web_search", {"query": query}, _results(rng, pool, 8, 0.2))


# ------------------------------------------------------------------------------ traps
# Distinct records that look alike in their words (issue 36): every call a new action (its
# exact fingerprint differs), every answer news about another record. Silent, each of them.


def distinct_documents(rng: random.Random, a: Agent) -> None:
    """A research agent walks 45 documents whose ids differ in a one-character token
    (`doc-0` ... `doc-44`); each answers the same words about itself. Its only finding is
    the step budget (40) at the 41st call."""
    chars = rng.choice((900, 1200))
    for k in range(45):
        a.turn([("kb_fetch", {"doc_id": f"doc-{k}"})])
        a.tool("kb_fetch", {"doc_id": f"doc-{k}"}, {"doc_id": f"doc-{k}", "chars": chars})


def id_sweep(rng: random.Random, a: Agent) -> None:
    """{"id": 1} ... {"id": 9}, each record described in the same words."""
    kind = rng.choice(("widget", "invoice", "ticket"))
    for k in range(1, 10):
        a.turn([("get_record", {"id": k})])
        a.tool("get_record", {"id": k}, {"id": k, "type": kind, "status": "active"})


def pages_of_one_query(rng: random.Random, a: Agent) -> None:
    """Pages 1-9 of one query; each page says the same words about other results."""
    query = " ".join(_word(rng) for _ in range(3))
    names = [_word(rng) for _ in range(3)]
    for page in range(1, 10):
        a.turn([("search_catalog", {"query": query, "page": page})])
        text = f"Page {page} of 9 for '{query}': " + ", ".join(f"{n} {page}" for n in names)
        a.tool("search_catalog", {"query": query, "page": page}, text)


def orders_same_status(rng: random.Random, a: Agent) -> None:
    """Three different orders (under an id key, or under a key that names none: then the
    values tell), all delivered: the same answer about three records."""
    key = rng.choice(("order_id", "orderId", "order"))
    ids = rng.choice(
        (
            [f"{c}-7" for c in rng.sample("ABCDEFGH", 3)],  # one-character tokens
            [f"A-{n}" for n in rng.sample(range(10), 3)],
            [f"A-{n}" for n in rng.sample(range(1000, 9999), 3)],
        )
    )
    for order in ids:
        args = {key: order, "include_items": False}
        a.turn([("order_status", args)])
        a.tool("order_status", args, {"status": "delivered"})


def tenants_same_query(rng: random.Random, a: Agent) -> None:
    """The same question for two tenants, asked once and once rephrased for each; every
    tenant's policy says the same."""
    key = rng.choice(("tenant", "tenant_id", "org", "workspace"))
    base = ["refund", "policy", "damaged", "items"]
    answer = {"answer": _prose(rng, 40)}
    for tenant in ("acme", "globex"):
        for query in (" ".join(base), _rephrase(rng, base)):
            args = {key: tenant, "question": query}
            a.turn([("policy_search", args)])
            a.tool("policy_search", args, answer)


def accounts_alike(rng: random.Random, a: Agent) -> None:
    """Accounts named by e-mail addresses that share all but one token."""
    domain = f"{_word(rng)}.example"
    for n in range(1, 5):
        args = {"email": f"user-{n}@{domain}", "fields": "plan status"}
        a.turn([("get_account", args)])
        a.tool("get_account", args, {"plan": "pro", "status": "active"})


LOOPS: dict[str, Callable[[random.Random, Agent], None]] = {
    "rephrased_search": rephrased_search,
    "page_walked_again": page_walked_again,
    "find_rephrased": find_rephrased,
    "code_agent_repeating": code_agent_repeating,
    "answer_rephrased": answer_rephrased,
}
PROGRESS: dict[str, Callable[[random.Random, Agent], None]] = {
    "pagination": pagination,
    "polling": polling,
    "fan_out": fan_out,
    "page_forward": page_forward,
    "new_results": new_results,
    "code_agent_progressing": code_agent_progressing,
    "answers_move_on": answers_move_on,
    "site_pages": site_pages,
    "unrelated_searches": unrelated_searches,
}


TRAPS: dict[str, Callable[[random.Random, Agent], None]] = {
    "distinct_documents": distinct_documents,
    "id_sweep": id_sweep,
    "pages_of_one_query": pages_of_one_query,
    "orders_same_status": orders_same_status,
    "tenants_same_query": tenants_same_query,
    "accounts_alike": accounts_alike,
}


def corpus(variants: int = 12, seed: int = 29) -> list[Case]:
    """The loops and the progress cases (the traps are `traps()`)."""
    return _cases(((True, LOOPS), (False, PROGRESS)), variants, seed, 1000)


def traps(variants: int = 6, seed: int = 36) -> list[Case]:
    return _cases(((False, TRAPS),), variants, seed, 5000)


def _cases(
    tables: tuple[tuple[bool, dict[str, Callable[[random.Random, Agent], None]]], ...],
    variants: int,
    seed: int,
    trace: int,
) -> list[Case]:
    cases = []
    for loop, table in tables:
        for name, build in table.items():
            for v in range(variants):
                trace += 1
                style = "genai" if v % 2 == 0 else "openinference"
                agent = Agent(trace, style)
                build(random.Random(seed * 1_000_003 + trace), agent)
                cases.append(Case(name, loop, agent.done(), agent))
    return cases
