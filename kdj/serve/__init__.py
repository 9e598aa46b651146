"""`kdj serve`: an OpenAI-compatible HTTP server over the slot-pool engine.

worker.py  the engine's device loop in one thread; requests in, token updates out
text.py    request bodies checked into engine requests; token streams into text
app.py     the FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health,
           /stats (the host's time, cumulative)
bench.py   `kdj bench-serve`: the concurrency sweep against any OpenAI-compatible server
prompts.py its prompts: a file, held-out ShareGPT, or synthetic requests
"""
