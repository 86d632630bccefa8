"""churon's HTTP server: `churon serve`, or create_app() for an ASGI server of your own.

    app.py         create_app: wires the parts below into one FastAPI app
    serve.py       make_server: the app on uvicorn, as `churon serve` runs it (file limit, SIGTERM's drain)
    connections.py under the app: header and body read deadlines, the connection limit
    state.py       what the routes share (the loaded models, metrics, admission, limits); a request's `model`
                   acquired for its task (text generation or embeddings), loaded on demand, unloaded by LRU or
                   keep_alive; the 503 while loading
    lora.py        the LoRA adapters a server serves by name (`--lora`, /v1/load_lora_adapter), each on its base
                   model: a request naming one runs on that model with it
    catalog.py     the models a server can load by name ($CHURON_HOME: cached, registry, created), what each
                   will hold, how it loads
    keep_alive.py  Ollama's keep_alive durations
    errors.py      APIError and the exception handlers: every error in its API's shape (OpenAI, Anthropic, Ollama)
    middleware.py  before any route: the API key, the body-size limit, answers counted by status, the 500 of a bug
    admission.py   --max-queue: engine requests waiting for their first token
    limits.py      the work one request may ask for: choices, prompt tokens, logit_bias, stop strings, logprobs,
                   embedding inputs
    offload.py     chat templates and tokenization on a thread pool of their own, off the event loop
    generation.py  the engine requests of one HTTP request, run together; its 400s, 499 and 503
    embedding.py   an embeddings request's inputs tokenized, checked, bounded and embedded (every API's)
    drain.py       the graceful shutdown: no new requests, a grace period, then every request ended properly
    metrics.py     Prometheus text
    system.py      /health, /metrics
    openai/        OpenAI's API (and vLLM's /tokenize, /detokenize); anthropic/ and ollama/ beside it
    page/          GET /: the chat page (one static file, no CDN)
"""

from churon.server.app import create_app

__all__ = ["create_app"]
