"""churon's HTTP server: `churon serve`, or create_app() for an ASGI server of your own.

    app.py         create_app: wires the parts below into one FastAPI app
    state.py       what the routes share (the model once loaded, metrics, admission); the 503 while loading
    errors.py      APIError and the exception handlers: every error as OpenAI's error body
    middleware.py  before any route: the API key, the body-size limit, answers counted by status
    admission.py   --max-queue: engine requests waiting for their first token
    generation.py  the engine requests of one HTTP request, run together; its 400s and 499
    metrics.py     Prometheus text
    system.py      /health, /metrics
    openai/        OpenAI's API (and vLLM's /tokenize, /detokenize); other APIs get packages beside it
"""

from churon.server.app import create_app

__all__ = ["create_app"]
