"""GET /: the chat page, one static file shipped in the package (index.html: inline CSS and JS, no CDN,
no fonts from elsewhere), so it works offline. It talks to this server's own /v1/models and
/v1/chat/completions, as any client would."""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

PAGE = files(__name__).joinpath("index.html").read_text(encoding="utf-8")

# The browser itself holds the page to its promise: nothing from another host, requests to this one only
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                           "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'")

router = APIRouter()


# HEAD too: Ollama's own CLI checks that a server is up with HEAD / before any command
@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def chat_page() -> HTMLResponse:
    return HTMLResponse(PAGE, headers={"Content-Security-Policy": CONTENT_SECURITY_POLICY})
