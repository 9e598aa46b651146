"""The OpenAI-compatible FastAPI app over a `Worker` (kdj/serve/worker.py).

Errors, all in OpenAI's shape {"error": {message, type, param, code}}: a bad body -> 400
naming the field at fault (a field kdj does not honour is refused, never ignored), an
unknown path 404, a wrong method 405, a full queue -> 503, a failed engine step -> 500 for
the requests it held; the server keeps serving. A request's `n` choices are n engine
requests. A client that disconnects cancels them, which frees their slots at the engine's
next turn."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid

import jax
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from tqdm import tqdm

from kdj import api
from kdj.decode.engine import SERVE_WAKE_SHARE, Engine
from kdj.decode.requests import Update
from kdj.serve.text import MAX_N, Parsed, Scored, Served, TextStream, parse
from kdj.serve.worker import Overloaded, Ticket, Worker

POLL_S = 0.5  # how often a non-streaming handler checks that its client is still there
LAG_PROBE_S = 0.01  # how often the event loop's lag is sampled (GET /stats)
# the most steps a serving chunk runs: where a chunk's own cost (dispatch, loop entry, report)
# is a few steps' worth, about that many more amortise it; the engine runs fewer when it can
STREAM_STEPS = 16


class LoopLag:
    """How late the event loop runs a callback due now: a busy loop delays every stream's
    tokens and every admission by that much. Cumulative, like the engine's TurnStats."""

    def __init__(self):
        self.samples, self.total_s, self.max_s = 0, 0.0, 0.0

    async def probe(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(LAG_PROBE_S)
            lag = time.perf_counter() - t0 - LAG_PROBE_S
            self.samples += 1
            self.total_s += lag
            self.max_s = max(self.max_s, lag)


class Compiles:
    """XLA compiles in this process while it serves (after warm: none is expected; each one
    stalls every stream behind it). Cumulative, like LoopLag."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count, self.seconds = 0, 0.0

    def __call__(self, event: str, seconds: float, **_) -> None:
        if event == self.EVENT:
            self.count += 1
            self.seconds += seconds

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *_):
        jax.monitoring.unregister_event_duration_listener(self)


def error_body(message: str, kind: str, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error(status: int, message: str, kind: str = "invalid_request_error", param=None,
          code=None, headers=None) -> JSONResponse:  # fmt: skip
    """An error in OpenAI's shape."""
    body = error_body(message, kind, param, code)
    return JSONResponse(body, status_code=status, headers=headers)


def build_app(worker: Worker, served: Served) -> FastAPI:
    lag, compiles = LoopLag(), Compiles()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        with compiles:
            worker.start()
            probe = asyncio.create_task(lag.probe())
            yield
            probe.cancel()
            worker.stop()  # after uvicorn's graceful shutdown: cancels what is still running

    app = FastAPI(title="kdj", lifespan=lifespan)
    app.state.worker = worker  # for code that embeds the app (and tests) to reach the engine

    # every error in OpenAI's shape, not FastAPI's {"detail": ...}
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        where = f"{request.method} {request.url.path}"
        messages = {404: f"no such endpoint: {where}", 405: f"method not allowed: {where}"}
        message = messages.get(exc.status_code, str(exc.detail))
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error(exc.status_code, message, kind, code=code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return error(400, f"invalid request: {exc.errors()}")

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        return error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    @app.get("/health")
    async def health():
        engine = worker.engine  # width: the compiled width the pool runs at now
        return {"status": "ok", "in_flight": worker.in_flight, "slots": engine.B,
                "width": engine.width, "resizes": engine.resizes,
                "cancelled": worker.cancelled}  # fmt: skip

    pricing = worker.engine.pricing()  # fixed when the engine was built

    @app.get("/stats")
    async def stats():
        """Cumulative counters of the host's time (a benchmark differences two reads), and
        per width auto's pricing and what its chunks measured (why it runs what it runs)."""
        engine = worker.engine
        lagged = {"samples": lag.samples, "total_s": lag.total_s, "max_s": lag.max_s}
        return {"method": engine.method, "engine": dataclasses.asdict(engine.stats),
                "worker": dataclasses.asdict(worker.stats), "loop_lag": lagged,
                "compiles": {"count": compiles.count, "seconds": compiles.seconds},
                "chunk_steps": engine.chunk_steps.run, "step_ms": engine.chunk_steps.step_ms(),
                "pricing": pricing, "measured": engine.measured()}  # fmt: skip

    model = {"id": served.model, "object": "model", "created": int(time.time()),
             "owned_by": "kdj"}  # fmt: skip

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model]}

    @app.get("/v1/models/{name:path}")  # a model id may hold slashes (a checkpoint's path)
    async def one_model(name: str):
        if name != served.model:
            return error(404, f"unknown model {name!r}; this server serves {served.model!r}",
                         param="model", code="model_not_found")  # fmt: skip
        return model

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    async def handle(request: Request, chat: bool):
        try:
            body = json.loads(await request.body(), parse_constant=not_json)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(400, f"malformed JSON: {e}")
        tickets = []
        try:
            parsed = parse(body, served, chat)
            for r in parsed.requests:  # one engine request per choice
                tickets.append(worker.submit(r))
        except (ValueError, Overloaded) as e:
            for ticket in tickets:  # the choices queued before the refusal
                worker.cancel(ticket)
            if isinstance(e, Overloaded):
                return error(503, str(e), "server_overloaded")
            return error(400, str(e), param=getattr(e, "param", None),
                         code=getattr(e, "code", None))  # fmt: skip
        reply = Reply(served, parsed, chat)
        choices = Choices(worker, tickets)
        if parsed.stream:
            return StreamingResponse(stream(choices, reply), media_type="text/event-stream")
        return await complete(request, choices, reply)

    async def complete(request: Request, choices: Choices, reply: Reply):
        text = [[] for _ in choices.tickets]
        try:
            while choices.running:
                try:
                    item = await asyncio.wait_for(choices.arrivals.get(), POLL_S)
                except TimeoutError:
                    if await request.is_disconnected():
                        return error(499, "client disconnected")
                    continue
                if isinstance(item, Exception):
                    return error(500, str(item), "server_error")
                i = choices.index(item)
                if i in choices.running:  # else its text ended at a stop string
                    text[i].append(reply.feed(i, item))
                    if item.finished or reply.texts[i].stopped:
                        choices.end(i, item.finished)
        finally:  # a disconnect, a failure or a cancelled handler: free the slots
            choices.close()
        return reply.whole(["".join(t) for t in text])

    async def stream(choices: Choices, reply: Reply):
        try:
            while choices.running:
                item = await choices.arrivals.get()
                if isinstance(item, Exception):
                    yield sse(error_body(str(item), "server_error"))
                    return
                i = choices.index(item)
                if i not in choices.running:  # its text ended at a stop string
                    continue
                delta = reply.feed(i, item)
                scored = reply.fresh(i)
                if delta or scored:
                    yield sse(reply.chunk(i, delta, None, scored))
                if item.finished or reply.texts[i].stopped:
                    choices.end(i, item.finished)
                    yield sse(reply.chunk(i, "", reply.texts[i].finish_reason))
            if reply.usage_last:
                yield sse(reply.usage_chunk())
            yield "data: [DONE]\n\n"
        finally:  # disconnected, or failed: free the slots
            choices.close()

    return app


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class Choices:
    """The engine requests of one reply's n choices: their updates in the order they come,
    and freeing the slots of those still running."""

    def __init__(self, worker: Worker, tickets: list[Ticket]):
        self.worker, self.tickets = worker, tickets
        self.running = set(range(len(tickets)))  # the choices whose text is not complete
        self._pumps = []
        if len(tickets) == 1:
            self.arrivals = tickets[0].updates
        else:  # a task per choice forwards its updates into one queue
            self.arrivals = asyncio.Queue()
            self._pumps = [asyncio.create_task(self._pump(t)) for t in tickets]

    async def _pump(self, ticket: Ticket) -> None:
        while True:
            item = await ticket.updates.get()
            self.arrivals.put_nowait(item)
            if isinstance(item, Exception) or item.finished:
                return

    def index(self, update: Update) -> int:
        """The choice an update belongs to."""
        return next(i for i, t in enumerate(self.tickets) if t.request.id == update.id)

    def end(self, i: int, finished: bool) -> None:
        """Choice i's text is complete; `finished`: the engine ended it too (else a stop
        string did, and its slot is freed now)."""
        self.running.discard(i)
        if not finished:
            self.worker.cancel(self.tickets[i])

    def close(self) -> None:
        for pump in self._pumps:
            pump.cancel()
        for i in self.running:
            self.worker.cancel(self.tickets[i])
        self.running.clear()


class Reply:
    """The response objects of one request (OpenAI's shapes, a choice per engine request),
    with usage and decode stats summed over the choices, and the tokens' log-probabilities
    when the request asked for them."""

    def __init__(self, served: Served, parsed: Parsed, chat: bool):
        self.served, self.chat = served, chat
        self.prompt_tokens = parsed.prompt_tokens
        self.texts = [TextStream(served, parsed.stops) for _ in parsed.requests]
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.steps = [0] * len(parsed.requests)  # the engine's steps per choice so far
        self.usage_stream, self.usage_last = parsed.usage_stream, parsed.usage_last
        self.logprobs = parsed.requests[0].logprobs is not None
        self.shown = [0] * len(parsed.requests)  # each choice's scored tokens streamed so far
        self.roled: set[int] = set()  # the choices whose stream has said its role (the first)

    def feed(self, i: int, update: Update) -> str:
        """The text delta of an engine update to choice i."""
        self.steps[i] = update.steps
        return self.texts[i].feed(update.tokens, update.finished, update.logprobs)

    def fresh(self, i: int) -> list[Scored]:
        """Choice i's scored tokens since the last call (streaming)."""
        new = self.texts[i].scored[self.shown[i] :]
        self.shown[i] += len(new)
        return new

    def _logprobs(self, scored: list[Scored] | None) -> dict | None:
        """OpenAI's logprobs object of `scored` tokens; None when the request asked for none
        (or a stream's last chunk, which has no tokens)."""
        if not self.logprobs or scored is None:
            return None
        if self.chat:
            return {"content": [chat_logprob(s) for s in scored], "refusal": None}
        return {"tokens": [s.text for s in scored], "token_logprobs": [s.logprob for s in scored],
                "top_logprobs": [completion_top(s) for s in scored],
                "text_offset": [s.offset for s in scored]}  # fmt: skip

    def usage(self) -> dict:
        counts = [len(t.tokens) for t in self.texts]  # as decoded
        n = sum(len(t.tokens) if t.kept is None else t.kept for t in self.texts)  # as replied
        steps = sum(self.steps)
        # tokens per step: prefill gives each choice its first token, each step one or more
        mean = sum(max(c - 1, 0) for c in counts) / steps if steps else None
        stats = {"method": self.served.method, "steps": steps, "mean_acceptance": mean}
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n,
                "total_tokens": self.prompt_tokens + n, "kdj": stats}  # fmt: skip

    def _choice(self, i: int, text, finish, delta: bool, scored: list[Scored] | None) -> dict:
        logprobs = self._logprobs(scored)
        if not self.chat:
            return {"index": i, "text": text, "finish_reason": finish, "logprobs": logprobs}
        if not delta:
            message = {"role": "assistant", "content": text}
            return {"index": i, "message": message, "finish_reason": finish, "logprobs": logprobs}
        # as OpenAI streams: the role in a choice's first delta only
        said = {} if i in self.roled else {"role": "assistant"}
        self.roled.add(i)
        return {"index": i, "delta": {**said, "content": text}, "finish_reason": finish,
                "logprobs": logprobs}  # fmt: skip

    def whole(self, texts: list[str]) -> dict:
        choices = [self._choice(i, text, t.finish_reason, False, t.scored)
                   for i, (text, t) in enumerate(zip(texts, self.texts))]  # fmt: skip
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.served.model, "choices": choices,
                "usage": self.usage()}  # fmt: skip

    def chunk(self, i: int, text: str, finish, scored: list[Scored] | None = None) -> dict:
        """A streamed chunk of choice i: with the usage so far where the request asked for it
        on every chunk (continuous_usage_stats), else a null one where it asked for a last
        usage chunk (include_usage), as OpenAI's chunks have."""
        obj = self._chunk([self._choice(i, text, finish, True, scored)])
        if self.usage_stream:
            obj["usage"] = self.usage()
        elif self.usage_last:
            obj["usage"] = None
        return obj

    def usage_chunk(self) -> dict:
        """A stream's last chunk with include_usage: the whole usage, no choices."""
        return {**self._chunk([]), "usage": self.usage()}

    def _chunk(self, choices: list[dict]) -> dict:
        return {"id": self.id, "created": self.created, "model": self.served.model,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "choices": choices}  # fmt: skip


def not_json(name: str):
    """NaN, Infinity and -Infinity, which Python's json module reads but JSON has not: a
    number field holding one would slip past every range check."""
    raise json.JSONDecodeError(f"{name} is not a JSON number", name, 0)


def chat_logprob(s: Scored) -> dict:
    """A token of chat's logprobs.content: its text, log-probability, the UTF-8 bytes of its
    text (a character split across tokens is the last one's), and its alternatives."""
    top = [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in s.top]
    return {"token": s.text, "logprob": s.logprob, "bytes": list(s.text.encode()),
            "top_logprobs": top}  # fmt: skip


def completion_top(s: Scored) -> dict:
    """A token of completions' top_logprobs: {text: log-probability} of the token itself and
    of its alternatives (OpenAI's up to k + 1 entries). Texts can be equal (tokens that each
    begin an unfinished character add ""): the token's own entry stands, then the likelier."""
    top = {s.text: s.logprob}
    for text, value in s.top:
        top.setdefault(text, value)
    return top


def serving_engine(target, drafter=None, method: str = "ar", block_size=None, tree_budget=None,
                   max_batch: int = 8, context: int = 2048, chunk_steps=None,
                   temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, widths=None,
                   cost=None) -> Engine:  # fmt: skip
    """The slot pool a server runs (make_app's arguments): each slot `context` tokens, a
    request up to all of them, a host turn per finished share (SERVE_WAKE_SHARE) of the
    live slots. Chunks run `chunk_steps` steps if given (an int, or one per width), else as
    few, up to STREAM_STEPS, as keep the device busy and amortise each chunk's own cost
    (kdj/decode/turns.py ChunkSteps): tokens then reach their streams a few steps apart."""
    opts = api.check_options(target, drafter, method, block_size, tree_budget, None, None,
                             temperature, top_p, None, cost)  # fmt: skip
    drafting = api.pool_drafting(opts, target, drafter, max_batch, context, context / 2,
                                 cost, widths)  # fmt: skip
    follow = chunk_steps is None
    if follow:
        chunk_steps = STREAM_STEPS
    return Engine(target, max_batch, context, context - 1, chunk_steps=chunk_steps, seed=seed,
                  widths=widths, wake_share=SERVE_WAKE_SHARE, follow_host=follow,
                  **drafting)  # fmt: skip


def make_app(target, name: str, *, drafter=None, method: str = "ar", block_size=None,
             tree_budget=None, max_batch: int = 8, context: int = 2048, max_tokens: int = 256,
             max_queue: int = 64, chunk_steps: int | None = None, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, widths=None,
             warm: tuple[bool, ...] = (), cost=None) -> FastAPI:  # fmt: skip
    """The app serving `target` (a kdj.Target with a tokenizer) as model `name`: a pool of
    max_batch slots of `context` tokens each, up to max_queue requests waiting;
    max_tokens / temperature / top_p are the defaults of a request that gives none; widths:
    the pool's ladder of compiled widths (kdj/decode/engine.py `Engine`). With a
    `drafter`, method "dflash", "ddtree" or "auto" (block_size, tree_budget as kdj.generate
    takes them) decodes speculatively in the pool; auto's default menu is priced once per
    width of the ladder, at half a slot's context (requests' lengths are not known yet),
    with `cost` as kdj.generate takes it (default: each width's tuned cost, tuned now on an
    accelerator where none is cached).
    warm: the modes (greedy True, sampled False) whose programs are all compiled now, so
    no such request waits for a compile (Engine.warm)."""
    if target.tokenizer is None:
        raise ValueError("serving needs the target's tokenizer (this target has none)")
    engine = serving_engine(target, drafter, method, block_size, tree_budget, max_batch, context,
                            chunk_steps, temperature, top_p, seed, widths, cost)  # fmt: skip
    tok = target.tokenizer
    stop_ids = tuple(sorted(tok.stop_ids or target.cfg.eos_token_ids))
    cap = min(max_tokens, context - 1)
    if warm:
        with tqdm(desc="compiling the pool's programs", unit="program") as bar:

            def tick(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)

            engine.warm(warm, progress=tick)
    max_n = min(MAX_N, max_batch + max_queue)  # more choices than that never run at once
    served = Served(name, tok, stop_ids, cap, temperature, top_p, engine.method, max_n,
                    context)  # fmt: skip
    return build_app(Worker(engine, max_queue), served)
