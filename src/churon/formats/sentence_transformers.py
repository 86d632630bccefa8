"""A sentence-transformers directory's modules after the transformer, as a PoolingConfig.

    modules.json                  the modules in order: Transformer, Pooling, Normalize (optional). "type"
                                  is the module's class path, sentence_transformers.models.Pooling up to 5.x,
                                  sentence_transformers.sentence_transformer.modules.pooling.Pooling in 6.x:
                                  the class name is what counts. Normalize has no files (all-MiniLM-L6-v2
                                  ships no 2_Normalize folder).
    <Pooling's path>/config.json  pooling_mode_mean_tokens / _cls_token / _lasttoken / ... booleans (up to
                                  5.x), or pooling_mode "mean" | "cls" | "lasttoken" (6.x); include_prompt
    sentence_bert_config.json     max_seq_length: inputs longer are truncated to it; do_lower_case

Anything else in the pipeline (a Dense projection, a LayerNorm, another pooling mode, pooling that
leaves out the prompt) changes the vectors, so it is an UnsupportedModelError naming it, never skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from churon.config import MAX_CONTEXT_LENGTH, ConfigReader, PoolingConfig
from churon.errors import ModelFileError, UnsupportedModelError
from churon.formats.model_dir import inside, read_json, read_json_object

MODULES = "modules.json"
SBERT_CONFIG = "sentence_bert_config.json"

# sentence-transformers' pooling mode -> PoolingConfig.mode
POOLING_MODES = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
# the classic config's booleans -> the mode each selects (sentence_transformers' _LEGACY_POOLING_MODE_KWARGS)
LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


def read_pipeline(model_dir: Path) -> tuple[PoolingConfig | None, dict[str, Any]]:
    """(the pooling the directory declares, notes for the config's extra); (None, {}) without modules.json."""
    if not (model_dir / MODULES).exists():
        return None, {}
    modules = _modules(model_dir)
    kinds = [kind for kind, _ in modules]
    if kinds[0] != "Transformer":
        raise UnsupportedModelError(f"{model_dir / MODULES}: the first module is {kinds[0]}; only a Transformer"
                                    " (the model's own weights) can come first")
    for i, (kind, path) in enumerate(modules[1:], start=1):
        expected = "Pooling" if i == 1 else "Normalize"
        if kind != expected or i > 2:
            what = "a projection of the vectors" if kind == "Dense" else "a module churon does not run"
            raise UnsupportedModelError(
                f"{model_dir / MODULES}: module {i} is {kind} ({path or 'the top folder'}), {what}"
                " (supported: Transformer, Pooling, then an optional Normalize)")
    if len(modules) < 2:
        raise UnsupportedModelError(f"{model_dir / MODULES}: no Pooling module (the model gives one vector per"
                                    " token, not per input)")
    mode = _pooling_mode(inside(model_dir, modules[1][1], f"{model_dir / MODULES}: module 1", "folder") / "config.json")
    max_length, lower_case = _sbert_config(model_dir)
    pooling = PoolingConfig(mode, normalize=len(modules) == 3, max_length=max_length)
    return pooling, ({"do_lower_case": True} if lower_case else {})  # the tokenizer's normalizer handles case


def _modules(model_dir: Path) -> list[tuple[str, str]]:
    """(class name, path) of each module of modules.json, in order."""
    path = model_dir / MODULES
    entries = read_json(path)
    if not isinstance(entries, list) or not entries:
        raise ModelFileError(f"{path}: expected a non-empty JSON list of modules, found {entries!r:.80}")
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ModelFileError(f"{path}: module {i} is {entry!r:.80}, not an object")
        kind, folder = entry.get("type"), entry.get("path", "")
        if not isinstance(kind, str) or not kind:
            raise ModelFileError(f"{path}: module {i} has type {kind!r:.80}, not a class name")
        if not isinstance(folder, str):
            raise ModelFileError(f"{path}: module {i} has path {folder!r:.80}, not a folder name")
        out.append((kind.rsplit(".", 1)[-1], folder))
    return out


def _pooling_mode(path: Path) -> str:
    cfg = read_json_object(path)
    r = ConfigReader(cfg, str(path))
    if "pooling_mode" in cfg:  # sentence-transformers 6
        modes = cfg["pooling_mode"] if isinstance(cfg["pooling_mode"], list) else [cfg["pooling_mode"]]
        if not all(isinstance(m, str) for m in modes):
            raise ModelFileError(f"{path}: pooling_mode = {cfg['pooling_mode']!r:.80} is not a mode name or a list of them")
    else:
        modes = [mode for key, mode in LEGACY_POOLING_KEYS.items() if r.boolean(key, False)]
        modes = modes or ["mean"]  # what sentence-transformers does when no flag is set
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise UnsupportedModelError(
            f"{path}: pooling {' + '.join(modes) or 'none'} is not supported (supported: one of {', '.join(POOLING_MODES)})")
    if not r.boolean("include_prompt", True):
        raise UnsupportedModelError(f"{path}: include_prompt = false (pooling that leaves out an instruction"
                                    " prompt's tokens) is not supported")
    return POOLING_MODES[modes[0]]


def _sbert_config(model_dir: Path) -> tuple[int | None, bool]:
    """(max_seq_length or None, do_lower_case) of sentence_bert_config.json (both unset without one)."""
    path = model_dir / SBERT_CONFIG
    if not path.exists():
        return None, False
    r = ConfigReader(read_json_object(path), str(path))
    max_length = None if r.values.get("max_seq_length") is None else r.integer("max_seq_length", hi=MAX_CONTEXT_LENGTH)
    return max_length, r.boolean("do_lower_case", False)
