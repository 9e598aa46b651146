"""The OpenAI-compatible FastAPI app over a `Worker` (kdj/serve/worker.py).

Errors: a bad body -> 400 with the reason, a full queue -> 503, a failed engine step -> 500
for the requests it held; the server keeps serving. A client that disconnects cancels its
request, which frees its slot at the engine's next turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from tqdm import tqdm

from kdj import api
from kdj.decode.engine import SERVE_WAKE_SHARE, Engine, Update
from kdj.serve.text import Parsed, Served, TextStream, parse
from kdj.serve.worker import Overloaded, Ticket, Worker

POLL_S = 0.5  # how often a non-streaming handler checks that its client is still there
LAG_PROBE_S = 0.01  # how often the event loop's lag is sampled (GET /stats)


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


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


def build_app(worker: Worker, served: Served) -> FastAPI:
    lag = LoopLag()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()
        probe = asyncio.create_task(lag.probe())
        yield
        probe.cancel()
        worker.stop()  # after uvicorn's graceful shutdown: cancels what is still running

    app = FastAPI(title="kdj", lifespan=lifespan)

    @app.get("/health")
    async def health():
        engine = worker.engine  # width: the compiled width the pool runs at now
        return {"status": "ok", "in_flight": worker.in_flight, "slots": engine.B,
                "width": engine.width, "resizes": engine.resizes,
                "cancelled": worker.cancelled}  # fmt: skip

    @app.get("/stats")
    async def stats():
        """Cumulative counters of the host's time (a benchmark differences two reads)."""
        engine = worker.engine
        lagged = {"samples": lag.samples, "total_s": lag.total_s, "max_s": lag.max_s}
        return {"method": engine.method, "engine": dataclasses.asdict(engine.stats),
                "worker": dataclasses.asdict(worker.stats), "loop_lag": lagged}  # fmt: skip

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.model, "object": "model",
                                            "owned_by": "kdj"}]}  # fmt: skip

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    async def handle(request: Request, chat: bool):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(400, f"malformed JSON: {e}")
        try:
            parsed = parse(body, served, chat)
            ticket = worker.submit(parsed.request)
        except ValueError as e:
            return error(400, str(e))
        except Overloaded as e:
            return error(503, str(e), "server_overloaded")
        reply = Reply(served, parsed, chat)
        if parsed.stream:
            return StreamingResponse(stream(ticket, reply), media_type="text/event-stream")
        return await complete(request, ticket, reply)

    async def complete(request: Request, ticket: Ticket, reply: Reply):
        text = []
        try:
            while True:
                try:
                    item = await asyncio.wait_for(ticket.updates.get(), POLL_S)
                except TimeoutError:
                    if await request.is_disconnected():
                        worker.cancel(ticket)
                        return error(499, "client disconnected")
                    continue
                if isinstance(item, Exception):
                    return error(500, str(item), "server_error")
                text.append(reply.feed(item))
                if item.finished or reply.text.stopped:
                    break
        except asyncio.CancelledError:
            worker.cancel(ticket)
            raise
        if not item.finished:
            worker.cancel(ticket)  # a stop string ended the text before the engine did
        return reply.whole("".join(text))

    async def stream(ticket: Ticket, reply: Reply):
        finished = False
        try:
            while True:
                item = await ticket.updates.get()
                if isinstance(item, Exception):
                    finished = True
                    yield sse({"error": {"message": str(item), "type": "server_error"}})
                    break
                finished = item.finished
                delta = reply.feed(item)
                done = item.finished or reply.text.stopped
                if delta:
                    yield sse(reply.chunk(delta, None))
                if done:
                    yield sse(reply.chunk("", reply.text.finish_reason, usage=True))
                    yield "data: [DONE]\n\n"
                    break
        finally:
            if not finished:  # disconnected, or a stop string: free the slot
                worker.cancel(ticket)

    return app


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class Reply:
    """The response objects of one request (OpenAI's shapes), with usage and decode stats."""

    def __init__(self, served: Served, parsed: Parsed, chat: bool):
        self.served, self.chat = served, chat
        self.prompt_tokens = len(parsed.request.tokens)
        self.text = TextStream(served, parsed.stops)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.steps = 0  # the engine's steps for this request so far

    def feed(self, update: Update) -> str:
        """The text delta of an engine update."""
        self.steps = update.steps
        return self.text.feed(update.tokens, update.finished)

    def usage(self) -> dict:
        n = len(self.text.tokens)
        # tokens per step: prefill gives the first token, each step one or more
        mean = (n - 1) / self.steps if self.steps else None
        stats = {"method": self.served.method, "steps": self.steps, "mean_acceptance": mean}
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n,
                "total_tokens": self.prompt_tokens + n, "kdj": stats}  # fmt: skip

    def _choice(self, text, finish, delta: bool) -> dict:
        if not self.chat:
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        key = "delta" if delta else "message"
        return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish}

    def whole(self, text: str) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.served.model,
                "choices": [self._choice(text, self.text.finish_reason, delta=False)],
                "usage": self.usage()}  # fmt: skip

    def chunk(self, text: str, finish, usage: bool = False) -> dict:
        obj = {"id": self.id, "created": self.created, "model": self.served.model,
               "object": "chat.completion.chunk" if self.chat else "text_completion",
               "choices": [self._choice(text, finish, delta=True)]}  # fmt: skip
        if usage:
            obj["usage"] = self.usage()
        return obj


def make_app(target, name: str, *, drafter=None, method: str = "ar", block_size=None,
             tree_budget=None, max_batch: int = 8, context: int = 2048, max_tokens: int = 256,
             max_queue: int = 64, chunk_steps: int = 16, temperature: float = 0.0,
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
    opts = api.check_options(target, drafter, method, block_size, tree_budget, None, None,
                             temperature, top_p, None)  # fmt: skip
    tok = target.tokenizer
    stop_ids = tuple(sorted(tok.stop_ids or target.cfg.eos_token_ids))
    cap = min(max_tokens, context - 1)
    drafting = api.pool_drafting(opts, target, drafter, max_batch, context, context / 2,
                                 cost, widths)  # fmt: skip
    engine = Engine(target, max_batch, context, context - 1, chunk_steps=chunk_steps, seed=seed,
                    widths=widths, wake_share=SERVE_WAKE_SHARE, **drafting)  # fmt: skip
    if warm:
        with tqdm(desc="compiling the pool's programs", unit="program") as bar:

            def tick(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)

            engine.warm(warm, progress=tick)
    served = Served(name, tok, stop_ids, cap, temperature, top_p, engine.method)
    return build_app(Worker(engine, max_queue), served)
