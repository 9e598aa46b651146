"""OpenAI request bodies checked into engine requests, and token streams turned into text."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from kdj.decode.engine import Request
from kdj.tokenizer import Tokenizer

MAX_STOP_STRINGS = 4  # as OpenAI


@dataclasses.dataclass(frozen=True)
class Served:
    """What the server serves, and its defaults for a request's fields."""

    model: str
    tokenizer: Tokenizer
    stop_ids: tuple[int, ...]  # end-of-turn ids: they end a request and are left out of text
    max_tokens: int
    temperature: float
    top_p: float
    method: str = "ar"  # what the engine runs: ar, dflash, ddtree or auto (usage reports it)


class Parsed(NamedTuple):
    request: Request
    stream: bool
    stops: tuple[str, ...]  # stop strings: the text is cut before the first


def _number(body, name, default, lo, hi, lo_open=False) -> float:
    x = body.get(name, default)
    if x is None:
        x = default
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ValueError(f"'{name}' must be a number, got {x!r}")
    if x < lo or x > hi or (lo_open and x == lo):
        raise ValueError(f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {x}")
    return float(x)


def _integer(body, name, default, lo) -> int:
    x = body.get(name, default)
    if x is None:
        x = default
    if isinstance(x, bool) or not isinstance(x, int):
        raise ValueError(f"'{name}' must be an integer, got {x!r}")
    if x < lo:
        raise ValueError(f"'{name}' must be >= {lo}, got {x}")
    return x


def parse(body: Any, served: Served, chat: bool) -> Parsed:
    """ValueError naming the first thing wrong with the body."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    model = body.get("model", served.model)
    if model != served.model:
        raise ValueError(f"unknown model {model!r}; this server serves {served.model!r}")
    tok = served.tokenizer
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list of {role, content}")
        tokens = tok.encode(tok.apply_chat_template(messages))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            tokens = tok.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            if not all(0 <= t < tok.vocab_size for t in prompt):
                raise ValueError(f"prompt token ids must be in [0, {tok.vocab_size})")
            tokens = list(prompt)
        else:
            raise ValueError("'prompt' must be a string or a list of token ids (one prompt)")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError("'stop' must be a non-empty string or a list of them")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ValueError("'stream' must be true or false")
    seed = _integer(body, "seed", 0, 0) if body.get("seed") is not None else None
    if seed is not None and seed >= 2**32:
        raise ValueError(f"'seed' must be below 2**32, got {seed}")
    request = Request(
        tokens=tokens,
        max_new=_integer(body, "max_tokens", served.max_tokens, 1),
        stop=list(served.stop_ids),
        temperature=_number(body, "temperature", served.temperature, 0.0, 100.0),
        top_p=_number(body, "top_p", served.top_p, 0.0, 1.0, lo_open=True),
        seed=seed,
    )
    return Parsed(request, stream, tuple(stop))


class TextStream:
    """Tokens in, text deltas out: end-of-turn ids left out, stop strings cut, and text that
    may still become a stop string or an incomplete UTF-8 character held back.

    Decoding is incremental: each feed decodes only the ids since the last complete text,
    after a few ids of context (a tokenizer's decoder may treat a leading token specially),
    so a long reply costs O(its tokens), not O(tokens^2)."""

    CONTEXT = 4  # ids decoded again before the new ones

    def __init__(self, served: Served, stops: tuple[str, ...]):
        self.served, self.stops = served, stops
        self.tokens: list[int] = []
        self.ids: list[int] = []  # the tokens without end-of-turn ids
        self.done = 0  # ids[:done] decode to `text` completely
        self.text = ""
        self.sent = ""
        self.stopped = False  # a stop string or an end-of-turn id ended the text

    def _decoded(self) -> str:
        """The text of all ids; `text` / `done` advance when it ends in a whole character."""
        decode = self.served.tokenizer.decode
        ctx = max(0, self.done - self.CONTEXT)
        head = decode(self.ids[ctx : self.done])
        window = decode(self.ids[ctx:])
        if not window.startswith(head):  # the context decodes differently: start over
            full = decode(self.ids)
        else:
            full = self.text + window[len(head) :]
        if not full.endswith("\ufffd"):
            self.text, self.done = full, len(self.ids)
        return full

    def feed(self, tokens: list[int], final: bool) -> str:
        self.tokens += tokens
        stop_ids = self.served.stop_ids
        if any(t in stop_ids for t in tokens):
            self.stopped = True
        self.ids += [t for t in tokens if t not in stop_ids]
        text = self._decoded()
        # an earlier text held no stop string: only a match reaching past it is new
        cuts = [
            i for s in self.stops if (i := text.find(s, max(0, len(self.sent) - len(s) + 1))) >= 0
        ]
        if cuts:
            text, self.stopped, final = text[: min(cuts)], True, True
        if not final:
            hold = max((len(s) - 1 for s in self.stops), default=0)
            text = text[: len(text) - hold] if hold else text
            text = text.rstrip("\ufffd")
        delta = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent += delta
        return delta

    @property
    def finish_reason(self) -> str:
        return "stop" if self.stopped else "length"
