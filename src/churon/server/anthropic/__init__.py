"""Anthropic's Messages API, which Claude-style agents speak, as one router over the server's state:

    protocol.py      request bodies (pydantic), anthropic.types' *Param shapes
    conversation.py  content blocks -> the neutral chat-template conversation, its tools and prompt ids
    render.py        engine outputs as Message and content blocks; stop_reason
    streaming.py     server-sent events named by type: message_start ... message_stop
    messages.py      POST /v1/messages, /v1/messages/count_tokens

Tool calls go through churon.tool_calls, as OpenAI's do; errors on these paths come out in Anthropic's
shape (server/errors.py picks the dialect by path).
"""

from fastapi import APIRouter

from churon.server.anthropic import messages

router = APIRouter()
router.include_router(messages.router)
