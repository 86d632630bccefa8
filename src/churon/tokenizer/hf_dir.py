"""A tokenizer from a Hugging Face model directory: tokenizer.json, with tokenizer_config.json and
generation_config.json for the special tokens, and the chat template (chat_template.jinja,
chat_template.json or tokenizer_config.json's).

What encoding puts around a text comes from tokenizer.json's post-processor, as Hugging Face's
`tokenizer(text)` does: Llama's BOS in front, BERT's [CLS] in front and [SEP] after."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from churon.errors import ModelFileError
from churon.formats.hf import read_json_object
from churon.tokenizer.core import Tokenizer
from churon.tokenizer.gguf_vocab import EOG_TOKEN_TEXTS, not_ending_generation


def from_hf_dir(path: str | os.PathLike) -> Tokenizer:
    """Load tokenizer.json (+ tokenizer_config.json, generation_config.json) from a model directory."""
    path = Path(path)
    tj = path / "tokenizer.json"
    if not tj.is_file():
        raise ModelFileError(f"{path}: no tokenizer.json (churon needs the fast-tokenizer file)")
    try:
        hf = HFTokenizer.from_file(str(tj))
    except Exception as e:
        raise ModelFileError(f"{tj}: cannot be read by tokenizers: {e}") from e
    # sentence-transformers saves its padding and truncation (to 128 tokens, MiniLM) in tokenizer.json;
    # Hugging Face's tokenizer(text) applies neither unless asked, and cutting a text is the engine's job
    hf.no_padding()
    hf.no_truncation()
    config = _read_json(path / "tokenizer_config.json")
    gen = _read_json(path / "generation_config.json")

    def special(key: str) -> int | None:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            return None
        if not isinstance(value, str):
            raise ModelFileError(f"{path / 'tokenizer_config.json'}: {key} = {value!r} is not a token")
        tid = hf.token_to_id(value)
        if tid is None:
            raise ModelFileError(f"{path / 'tokenizer_config.json'}: {key} = {value!r} is not in tokenizer.json")
        return tid

    n_vocab = hf.get_vocab_size(with_added_tokens=True)

    def gen_id(value: Any, key: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n_vocab:
            raise ModelFileError(
                f"{path / 'generation_config.json'}: {key} = {value!r:.80} is not a token id"
                f" (tokenizer.json has {n_vocab} tokens)"
            )
        return value

    bos_id = special("bos_token")
    eos_id = special("eos_token")
    if bos_id is None and gen.get("bos_token_id") is not None:
        bos_id = gen_id(gen["bos_token_id"], "bos_token_id")
    gen_eos = gen.get("eos_token_id")
    if isinstance(gen_eos, list):
        gen_eos = [gen_id(v, f"eos_token_id[{i}]") for i, v in enumerate(gen_eos)]
    else:
        gen_eos = [] if gen_eos is None else [gen_id(gen_eos, "eos_token_id")]
    if eos_id is None and gen_eos:
        eos_id = gen_eos[0]
    eog = {i for i in [eos_id, *gen_eos] if i is not None}
    added = hf.get_added_tokens_decoder()
    continuing = not_ending_generation({tok.content for tok in added.values() if tok.special})
    for tid, tok in added.items():
        if tok.special and tok.content in EOG_TOKEN_TEXTS and tok.content not in continuing:
            eog.add(tid)

    # The post-processor's own special tokens (BERT's [CLS] / [SEP]) are BOS / EOS when the config names none;
    # the end-of-generation ids above stay the ones the config names (an encoder never generates).
    prefix, suffix = _post_processor_wrapping(hf)
    if bos_id is None and len(prefix) == 1:
        bos_id = prefix[0]
    if eos_id is None and len(suffix) == 1:
        eos_id = suffix[0]
    add_bos = _add_flag(config, "add_bos_token", bos_id is not None and prefix[:1] == [bos_id], bos_id, path)
    # The token a text ends with is the post-processor's, which need not be the EOS the config names (Qwen3-Embedding
    # appends <|endoftext|>, its config's EOS is <|im_end|>): the last-token pooling of such a model reads it.
    end_id = suffix[0] if len(suffix) == 1 else eos_id
    add_eos = _add_flag(config, "add_eos_token", len(suffix) == 1, end_id, path)

    template = None
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    elif (path / "chat_template.json").is_file():
        template = _read_json(path / "chat_template.json").get("chat_template")
    else:
        template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        by_name = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = by_name.get("default", next(iter(by_name.values()), None))
    if template is not None and not isinstance(template, str):
        raise ModelFileError(f"{path}: chat_template is not a string")
    return Tokenizer(
        hf,
        source=str(path),
        bos_id=bos_id,
        eos_id=eos_id,
        eog_ids=frozenset(eog),
        add_bos=add_bos,
        add_eos=add_eos,
        end_id=end_id,
        chat_template=template,
    )


def _post_processor_wrapping(hf: HFTokenizer) -> tuple[list[int], list[int]]:
    """The ids tokenizer.json's post-processor puts in front of and after a text's own ids."""
    with_special = hf.encode("a", add_special_tokens=True).ids
    without = hf.encode("a", add_special_tokens=False).ids
    for start in range(len(with_special) - len(without) + 1):
        if with_special[start : start + len(without)] == without:
            return with_special[:start], with_special[start + len(without) :]
    return [], []


def _add_flag(config: dict[str, Any], key: str, found: bool, token_id: int | None, path: Path) -> bool:
    """tokenizer_config.json's add_bos_token / add_eos_token, else what the post-processor was found to do."""
    value = config.get(key)
    if not isinstance(value, bool):
        return found
    if value and token_id is None:
        what = key.removeprefix("add_")
        raise ModelFileError(f"{path}: {key} is true but no {what} is defined")
    return value


def _read_json(path: Path) -> dict[str, Any]:
    """An optional JSON object file of the directory: {} when it is absent."""
    return read_json_object(path) if path.exists() else {}
