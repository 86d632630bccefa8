"""vLLM's runtime LoRA routes: POST /v1/load_lora_adapter {"lora_name", "lora_path"} serves the adapter at
lora_path (a PEFT directory or a GGUF adapter, on the server's machine) as the model lora_name; POST
/v1/unload_lora_adapter {"lora_name"} serves it no more. vLLM's answers: a line of text on success, an error
body otherwise (ServerState.load_adapter and unload_adapter say which). Off unless the server was started with
--allow-lora-loading, which lets a client have the server read any file it can: a 403 naming that flag."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from churon.server.openai.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from churon.server.state import ServerState, server_state

router = APIRouter()


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoraAdapterRequest, state: ServerState = Depends(server_state)) -> str:
    await state.load_adapter(body.lora_name, body.lora_path)
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, state: ServerState = Depends(server_state)) -> str:
    await state.unload_adapter(body.lora_name)
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
