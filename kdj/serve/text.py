"""OpenAI request bodies checked into engine requests, and token streams turned into text."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from kdj.decode.logprobs import MAX_TOP, TokenLogprob
from kdj.decode.requests import Request
from kdj.decode.sampling import spread_seeds
from kdj.tokenizer import Tokenizer

MAX_STOP_STRINGS = 4  # as OpenAI
MAX_N = 64  # choices per request; a server also caps it at its slots + queue

# The OpenAI fields kdj honours, per endpoint (a body with any other field is refused).
FIELDS = ("model", "max_tokens", "temperature", "top_p", "stream", "stop", "seed", "n")
CHAT_FIELDS = FIELDS + ("messages", "max_completion_tokens")
COMPLETION_FIELDS = FIELDS + ("prompt",)
# Accepted and ignored: the caller's own labels and parallel_tool_calls (moot: tools are
# refused). stream_options is read: include_usage adds a last chunk of the usage (as OpenAI),
# continuous_usage_stats puts the usage so far on every chunk (as vLLM: a client counts the
# tokens of each event).
IGNORED = ("user", "metadata", "stream_options", "parallel_tool_calls")
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")
# OpenAI fields kdj takes only at the value that leaves decoding as it is (null always does).
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}}
CHAT_NEUTRAL = {**NEUTRAL, "tools": [], "tool_choice": "none", "functions": [],
                "function_call": "none", "response_format": {"type": "text"},
                "store": False}  # fmt: skip
COMPLETION_NEUTRAL = {**NEUTRAL, "best_of": 1, "echo": False, "suffix": ""}
# The log-probability fields (_logprobs): chat's flag and alternatives, completions' count.
LOGPROBS = {True: ("logprobs", "top_logprobs"), False: ("logprobs",)}
MAX_COMPLETION_LOGPROBS = 5  # completions' alternatives per token at most (OpenAI's bound)
ROLES = ("system", "developer", "user", "assistant")


class Invalid(ValueError):
    """A bad request (HTTP 400): `param` names the field at fault, `code` OpenAI's kind."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


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
    max_n: int = MAX_N  # the most choices one request may ask for
    context: int | None = None  # tokens a slot holds: the prompt and the reply


class Parsed(NamedTuple):
    requests: tuple[Request, ...]  # one engine request per choice: n per prompt, in order
    stream: bool
    stops: tuple[str, ...]  # stop strings: the text is cut before the first
    usage_stream: bool = False  # every streamed chunk carries the usage so far
    prompt_tokens: int = 0  # over the request's prompts (each counted once, whatever n)
    usage_last: bool = False  # a stream ends with a chunk of the whole usage, no choices


def _number(body, name, default, lo, hi, lo_open=False) -> float:
    x = body.get(name, default)
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise Invalid(f"'{name}' must be a number, got {x!r}", name)
    if not lo <= x <= hi or (lo_open and x == lo):  # a NaN fails it too
        interval = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise Invalid(f"'{name}' must be in {interval}, got {x}", name)
    return float(x)


def _integer(body, name, default, lo, hi=None) -> int:
    x = body.get(name, default)
    if isinstance(x, bool) or not isinstance(x, int):
        raise Invalid(f"'{name}' must be an integer, got {x!r}", name)
    if x < lo or (hi is not None and x > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise Invalid(f"'{name}' must be {bound}, got {x}", name)
    return x


def _check_fields(body: dict, chat: bool) -> None:
    """Refuse any field kdj would otherwise ignore: unknown ones, and OpenAI's it does not
    honour at a value other than their neutral one. The message names every such field."""
    honoured = CHAT_FIELDS if chat else COMPLETION_FIELDS
    neutral = CHAT_NEUTRAL if chat else COMPLETION_NEUTRAL
    known = (*honoured, *IGNORED, *neutral, *LOGPROBS[chat])
    unknown = [name for name in body if name not in known]
    if unknown:
        endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        takes = (*honoured, *LOGPROBS[chat], *IGNORED)
        raise Invalid(f"unrecognized field{'s' * (len(unknown) > 1)} "
                      f"{', '.join(map(repr, unknown))} for {endpoint}; kdj takes "
                      f"{', '.join(takes)}", unknown[0], "unknown_parameter")  # fmt: skip
    moved = [(n, v) for n, v in body.items() if n in neutral and v is not None and v != neutral[n]]
    if moved:
        why = "; ".join(f"'{n}': leave it out or send {neutral[n]!r}, got {v!r}" for n, v in moved)
        raise Invalid(f"not supported by kdj: {why}", moved[0][0], "unsupported_parameter")


def _logprobs(body: dict, chat: bool) -> int | None:
    """The log-probabilities the request asks for: None (none), else how many alternatives
    per token (0: the chosen token's only)."""
    if chat:
        wanted = body.get("logprobs", False)
        if not isinstance(wanted, bool):
            raise Invalid(f"'logprobs' must be true or false, got {wanted!r}", "logprobs")
        if "top_logprobs" in body:
            k = _integer(body, "top_logprobs", 0, 0, MAX_TOP)
            if not wanted:
                raise Invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
            return k
        return 0 if wanted else None
    if "logprobs" not in body:
        return None
    return _integer(body, "logprobs", 0, 0, MAX_COMPLETION_LOGPROBS)


def _content(m: dict, i: int) -> str:
    """A message's text: a string, or OpenAI's list of text parts joined."""
    content = m.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        kinds = {p.get("type") for p in content}
        if kinds <= {"text"} and all(isinstance(p.get("text"), str) for p in content):
            return "".join(p["text"] for p in content)
        raise Invalid(f"messages[{i}].content: kdj serves text only (parts of type "
                      f"'text' with a string 'text'), got types {sorted(map(str, kinds))}",
                      "messages")  # fmt: skip
    raise Invalid(f"messages[{i}].content must be a string or a list of text parts, got "
                  f"{content!r}", "messages")  # fmt: skip


def _messages(body: dict) -> list[dict]:
    """The chat's messages as the chat template takes them ({role, content: str})."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Invalid("'messages' must be a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise Invalid(f"messages[{i}] must be an object {{role, content}}, got {m!r}",
                          "messages")  # fmt: skip
        m = {k: v for k, v in m.items() if v is not None}  # null: absent, as OpenAI
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise Invalid(f"messages[{i}] has fields kdj does not support: {extra} (it takes "
                          "role and content)", "messages")  # fmt: skip
        if m.get("role") not in ROLES:
            raise Invalid(f"messages[{i}].role must be one of {', '.join(ROLES)}, got "
                          f"{m.get('role')!r}", "messages")  # fmt: skip
        # developer messages are what OpenAI's newer models call the system prompt
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _content(m, i)})
    return out


def _max_tokens(body: dict, served: Served, prompt: int, field: str) -> int:
    """max_completion_tokens (chat) supersedes the older max_tokens; both must then agree.
    Asked for, the prompt (the longest, `prompt` tokens) and the reply must fit a slot; not
    asked for, the server's default shrinks to the room the prompt leaves (as OpenAI's
    does), and only a prompt that leaves none is refused (`field`: the prompt's)."""
    new, old = body.get("max_completion_tokens"), body.get("max_tokens")
    if new is not None and old is not None and new != old:
        raise Invalid(f"'max_completion_tokens' ({new!r}) and 'max_tokens' ({old!r}) differ; "
                      "send one ('max_tokens' is its older name)",
                      "max_completion_tokens")  # fmt: skip
    context = served.context
    room = None if context is None else context - prompt
    if new is None and old is None:
        if room is not None and room < 1:
            raise Invalid(f"the prompt ({prompt} tokens) leaves no room for a reply in the "
                          f"context of {context} tokens", field,
                          "context_length_exceeded")  # fmt: skip
        return served.max_tokens if room is None else min(served.max_tokens, room)
    name = "max_completion_tokens" if new is not None else "max_tokens"
    asked = _integer(body, name, served.max_tokens, 1, None if context is None else context - 1)
    if room is not None and asked > room:
        raise Invalid(f"the prompt ({prompt} tokens) + {name} ({asked}) exceed the context of "
                      f"{context} tokens: ask for {max(room, 0)} or fewer, or shorten the "
                      "prompt", name, "context_length_exceeded")  # fmt: skip
    return asked


def _seeds(seed: int | None, n: int) -> list[int | None]:
    """A seed per choice, so sampled choices differ (spread as kdj.generate spreads one seed
    over its prompts): without a request seed the engine derives one from each request's id."""
    return [None] * n if seed is None else spread_seeds(seed, n)


def parse(body: Any, served: Served, chat: bool) -> Parsed:
    """Invalid (a ValueError) naming the first thing wrong with the body."""
    if not isinstance(body, dict):
        raise Invalid("the body must be a JSON object")
    _check_fields(body, chat)
    body = {k: v for k, v in body.items() if v is not None}  # null: the default, as OpenAI
    logprobs = _logprobs(body, chat)
    model = body.get("model", served.model)
    if model != served.model:
        raise Invalid(f"unknown model {model!r}; this server serves {served.model!r}", "model",
                      "model_not_found")  # fmt: skip
    tok = served.tokenizer
    if chat:
        prompts = [tok.encode(tok.apply_chat_template(_messages(body)))]
    else:
        prompts = _prompts(body.get("prompt"), tok)
    stop = body.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise Invalid("'stop' must be a non-empty string or a list of them", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise Invalid(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise Invalid("'stream' must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise Invalid("'stream_options' must be an object", "stream_options")
    if options and not stream:  # as OpenAI: options of a stream there is none of
        raise Invalid("'stream_options' is only allowed with 'stream': true", "stream_options")
    for key, value in options.items():
        if key not in STREAM_OPTIONS:
            raise Invalid(f"unrecognized stream option {key!r}; kdj takes "
                          f"{', '.join(STREAM_OPTIONS)}", "stream_options")  # fmt: skip
        if not isinstance(value, bool):
            raise Invalid(f"stream_options.{key} must be true or false", "stream_options")
    seed = _integer(body, "seed", 0, 0, 2**32 - 1) if "seed" in body else None
    n = _integer(body, "n", 1, 1, served.max_n)
    if len(prompts) * n > served.max_n:
        raise Invalid(f"{len(prompts)} prompts x n={n} make {len(prompts) * n} choices; this "
                      f"server takes at most {served.max_n} a request", "prompt")  # fmt: skip
    max_new = _max_tokens(body, served, max(map(len, prompts)), "messages" if chat else "prompt")
    temperature = _number(body, "temperature", served.temperature, 0.0, 100.0)
    top_p = _number(body, "top_p", served.top_p, 0.0, 1.0, lo_open=True)
    requests = tuple(Request(list(tokens), max_new, list(served.stop_ids), temperature, top_p, s,
                             logprobs) for tokens in prompts for s in _seeds(seed, n))  # fmt: skip
    return Parsed(requests, stream, tuple(stop), options.get("continuous_usage_stats", False),
                  sum(map(len, prompts)), options.get("include_usage", False))  # fmt: skip


def _prompts(prompt: Any, tok) -> list[list[int]]:
    """/v1/completions' `prompt` as token ids, one list per prompt: a string, a list of token
    ids, or a non-empty list of either (a batch: each prompt gets n choices)."""
    if isinstance(prompt, str) or _ids(prompt):
        batch = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _ids(p)
                                                     for p in prompt):  # fmt: skip
        batch = prompt
    else:
        raise Invalid("'prompt' must be a string, a list of token ids, or a non-empty list of "
                      "either", "prompt")  # fmt: skip
    out = []
    for p in batch:
        if isinstance(p, list) and not all(0 <= t < tok.vocab_size for t in p):
            raise Invalid(f"prompt token ids must be in [0, {tok.vocab_size})", "prompt")
        out.append(tok.encode(p) if isinstance(p, str) else list(p))
    return out


def _ids(x: Any) -> bool:
    """A non-empty list of token ids (ints, not bools)."""
    return isinstance(x, list) and bool(x) and all(type(t) is int for t in x)


class Scored(NamedTuple):
    """A token of the reply with its log-probabilities, as the reply shows it."""

    text: str  # what it adds to the text (a character split across tokens: the last one's)
    offset: int  # where that text starts in the reply's text
    logprob: float
    top: list[tuple[str, float]]  # the alternatives' texts in the same place, most likely first


class TextStream:
    """Tokens in, text deltas out: end-of-turn ids left out, stop strings cut, and text that
    may still become a stop string or an incomplete UTF-8 character held back. Fed tokens'
    log-probabilities, it also gives each token's `Scored` once the text it begins in is out
    (`scored`): the tokens whose text starts before a stop string, end-of-turn ids left out.

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
        self.scored: list[Scored] = []  # the tokens whose text is out
        self._held: list[Scored] = []  # and those whose text is not yet
        self._end = 0  # where the next scored token's text starts
        self._starts = [0]  # ids positions where a character starts: a scored context's start
        self.kept: int | None = None  # tokens up to the end of the stop string that cut it

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

    def _score(self, token: int, logprob: TokenLogprob) -> None:
        """Append `token` to ids, held with its text, offset and alternatives."""
        decode = self.served.tokenizer.decode
        n = len(self.ids)
        # the context starts where a character does: mid-character, its first bytes would
        # decode to U+FFFD in front of the text (and stay there in every token's)
        start = max(b for b in self._starts if b <= max(0, n - self.CONTEXT))
        if n - start > 4 * self.CONTEXT:  # bytes that never made a character: let them go
            start = n - self.CONTEXT
        self._starts = [b for b in self._starts if b >= start] or [start]
        context = self.ids[start:]
        head = decode(context).rstrip("\ufffd")  # complete characters only, as `text`

        def added(t: int) -> str:  # the complete characters token t adds after the context
            text = decode(context + [t]).rstrip("\ufffd")
            return text[len(head) :] if text.startswith(head) else ""

        own = added(token)
        top = [(added(t), v) for t, v in logprob.top]
        self._held.append(Scored(own, self._end, logprob.logprob, top))
        self._end += len(own)
        self.ids.append(token)
        if not decode(context + [token]).endswith("\ufffd"):  # its last character is whole
            self._starts.append(n + 1)

    def feed(self, tokens: list[int], final: bool,
             logprobs: list[TokenLogprob] | None = None) -> str:  # fmt: skip
        """The text delta of `tokens` (with their log-probabilities, when given)."""
        self.tokens += tokens
        stop_ids = self.served.stop_ids
        if any(t in stop_ids for t in tokens):
            self.stopped = True
        if logprobs is None:
            self.ids += [t for t in tokens if t not in stop_ids]
        else:
            for t, lp in zip(tokens, logprobs, strict=True):
                if t not in stop_ids:
                    self._score(t, lp)
        text = self._decoded()
        # an earlier text held no stop string: only a match reaching past it is new
        cuts = [
            i for s in self.stops if (i := text.find(s, max(0, len(self.sent) - len(s) + 1))) >= 0
        ]
        if cuts:
            end = min(i + len(s) for s in self.stops if (i := text.find(s)) == min(cuts))
            self.kept = self._tokens_to(end)
            text, self.stopped, final = text[: min(cuts)], True, True
        if not final:
            hold = max((len(s) - 1 for s in self.stops), default=0)
            text = text[: len(text) - hold] if hold else text
        text = text.rstrip("\ufffd")  # a character no token completed (yet, or ever: cut off)
        delta = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent += delta
        out = [s for s in self._held if s.offset < len(self.sent) or (final and not cuts)]
        self.scored += out
        self._held = self._held[len(out) :]
        return delta

    def _tokens_to(self, end: int) -> int:
        """The fewest tokens whose text reaches `end` characters: the reply's tokens up to the
        one that completes its stop string (the pool may have decoded more by the time a
        chunk ends; usage counts these, as OpenAI's does)."""
        decode = self.served.tokenizer.decode
        lo, hi = 1, len(self.ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(decode(self.ids[:mid]).rstrip("\ufffd")) >= end:
                hi = mid
            else:
                lo = mid + 1
        return lo

    @property
    def finish_reason(self) -> str:
        return "stop" if self.stopped else "length"
