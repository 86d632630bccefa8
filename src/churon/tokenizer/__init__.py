"""Text <-> token ids for one model: the Tokenizer, how to build one from a model file, the chat
template, and the detokenizer that streams a request's text and finds its stop strings.

    core.py           Tokenizer: encode, decode, token bytes, apply_chat_template
    gguf_vocab.py     from_gguf: llama.cpp's tokenizer from GGUF metadata (pre-tokenizers, EOG ids, SPM merges,
                      BERT's WordPiece)
    hf_dir.py         from_hf_dir: tokenizer.json and its companion files
    chat_template.py  sandboxed jinja2 templates
    go_template.py    Ollama's Go-template prompt templates translated to a Jinja chat template
    detokenizer.py    Detokenizer: incremental text and stop strings in one update()
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from churon.tokenizer.chat_template import ChatTemplateError, ChatTemplateLimitError
from churon.tokenizer.core import Tokenizer
from churon.tokenizer.detokenizer import Detokenizer
from churon.tokenizer.gguf_vocab import from_gguf
from churon.tokenizer.hf_dir import from_hf_dir

if TYPE_CHECKING:
    from churon.formats.source import ModelSource


def load_tokenizer(source: ModelSource) -> Tokenizer:
    """The tokenizer a model file carries: GGUF metadata, or a Hugging Face directory's tokenizer files."""
    if source.format == "gguf":
        return from_gguf(source.metadata, source=str(source.path))
    return from_hf_dir(source.path)


__all__ = ["Tokenizer", "ChatTemplateError", "ChatTemplateLimitError", "Detokenizer", "from_gguf", "from_hf_dir", "load_tokenizer"]
