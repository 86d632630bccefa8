"""Created models: a name for a base model with a recipe (a Modelfile's system prompt, parameters, template,
seeded messages, license), stored as one small JSON manifest under $CHURON_HOME/manifests/, never a copy of
the weights.

A name is Ollama's: parts of letters, digits, ".", "_" and "-" separated by "/", and an optional ":tag"
(":latest" when none is given), so "mario" and "mario:latest" are one model, stored as manifests/mario/latest.json.
FROM is resolved when the model is created: a path (relative to the Modelfile's folder), else a created model
(whose base and recipe the new one inherits), else a registry name (pulled if it is not cached). ADAPTER, a LoRA
adapter (a PEFT directory or a GGUF adapter), is a path resolved as FROM's and read against the base model's
config when the model is created, so an adapter for another model is the create's error, not a request's.

A created model is loaded as LLM(base_path, max_model_len=num_ctx if given, lora_adapters=its lora_adapters),
every request with SamplingParams(lora=ADAPTER_LORA) when it has an ADAPTER; whoever renders its requests applies
its system prompt, template (a Jinja chat template: tokenizer.chat_template = model.template), parameters (as the
defaults a request's own options override) and messages (the history before the request's own).
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from churon.errors import ChuronError
from churon.modelfile import ROLES, Modelfile, ModelfileError, chat_template, parse_modelfile
from churon.ollama_options import check_options
from churon.registry import REGISTRY, cache_dir, models_dir, registry_entry, resolve_model

log = logging.getLogger(__name__)

MAX_NAME_LENGTH = 200  # Ollama's names are far shorter; a part must stay a file name
DEFAULT_TAG = "latest"
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_NAME = re.compile(rf"(?P<model>{_PART}(?:/{_PART})*)(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9._-]*))?")
FIELDS = ("from", "system", "parameters", "template", "messages", "license")  # /api/create's, without a Modelfile
ADAPTER_LORA = "ADAPTER"  # the name a created model's ADAPTER is loaded under in its LLM (SamplingParams.lora)


class ModelNotFoundError(ChuronError, LookupError):
    """No created model has this name."""


@dataclass
class CreatedModel:
    name: str  # canonical: "mario:latest"
    base: str  # FROM as written
    base_path: Path  # the GGUF file or HF directory FROM resolved to when the model was created
    adapter: Path | None = None  # the LoRA adapter ADAPTER resolved to, applied to every request
    system: str | None = None
    parameters: dict = field(default_factory=dict)  # checked Ollama options; stop a list
    template: str | None = None  # a Jinja chat template (a Go TEMPLATE translated)
    messages: list[dict] = field(default_factory=list)
    license: str | None = None
    modelfile: str = ""  # the canonical Modelfile (`show --modelfile`): FROM base_path, ADAPTER adapter, the recipe
    created_at: float = 0.0

    def conversation(self, messages: list[dict]) -> list[dict]:
        """Its seeded MESSAGEs, then a request's; its SYSTEM first unless the conversation has one."""
        seeded = [dict(m) for m in self.messages] + list(messages)
        if self.system is not None and not any(m.get("role") == "system" for m in seeded):
            seeded.insert(0, {"role": "system", "content": self.system})
        return seeded

    @property
    def lora_adapters(self) -> dict[str, Path]:
        """LLM's lora_adapters for this model: its ADAPTER as ADAPTER_LORA, or none."""
        return {ADAPTER_LORA: self.adapter} if self.adapter is not None else {}

    @property
    def recipe(self) -> Modelfile:
        """The recipe as its Modelfile writes it (the TEMPLATE as written, Go or Jinja)."""
        return parse_modelfile(self.modelfile)


def manifests_dir() -> Path:
    return cache_dir() / "manifests"


def check_name(name: str) -> str:
    """The canonical name ("mario" -> "mario:latest"); ValueError naming the name if it is not an Ollama name or
    would leave the model store."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"model name {name!r}: a name is needed")
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(f"model name {name[:40]!r}...: {len(name)} characters, more than {MAX_NAME_LENGTH}")
    if name.startswith("/") or "\\" in name:
        raise ValueError(f"model name {name!r}: a name is not a path (it may not start with / or hold \\)")
    if ".." in name:
        raise ValueError(f"model name {name!r}: '..' is not allowed in a name")
    if any(part.endswith(".json") for part in name.split(":")[0].split("/")):  # a manifest's own file name
        raise ValueError(f"model name {name!r}: a part of a name may not end in .json")
    m = _NAME.fullmatch(name)
    if m is None:
        raise ValueError(f"model name {name!r}: must be parts of letters, digits, '.', '_' and '-' separated by '/'"
                         " (each starting with a letter or digit), with an optional ':tag'")
    canonical = f"{m.group('model')}:{m.group('tag') or DEFAULT_TAG}"
    _manifest_path(canonical)  # refuses an escape of the store, should the rules above ever let one through
    return canonical


def _manifest_path(canonical: str) -> Path:
    model, tag = canonical.rsplit(":", 1)
    root = manifests_dir().resolve()
    path = (root / model / f"{tag}.json").resolve()
    if root not in path.parents:
        raise ValueError(f"model name {canonical!r}: its manifest would be outside the model store {root}")
    return path


def _known(name: str) -> str | None:
    """The canonical name of a valid one, else None (a path, a registry name with odd characters)."""
    try:
        return check_name(name)
    except ValueError:
        return None


def get_model(name: str) -> CreatedModel | None:
    """The created model of this name; None if there is none (or the name is not one a created model can have)."""
    canonical = _known(name)
    if canonical is None:
        return None
    path = _manifest_path(canonical)
    return _read(path) if path.is_file() else None


def list_models() -> list[CreatedModel]:
    """Every created model, by name. A manifest that cannot be read is left out, with a warning naming it."""
    root = manifests_dir()
    models = []
    for path in sorted(root.rglob("*.json")) if root.is_dir() else []:
        try:
            models.append(_read(path))
        except ChuronError as e:
            log.warning("%s", e)
    return sorted(models, key=lambda m: m.name)


def create_model(name: str, modelfile: str, *, base_dir: Path | None) -> CreatedModel:
    """Create (or replace) `name` from a Modelfile's text; FROM and ADAPTER paths are relative to base_dir (the
    Modelfile's folder); base_dir None (a request over HTTP) takes no path, only a model of the store, the registry
    or the cache by name: a client does not open files on the server. ModelfileError naming the line for a bad
    Modelfile, a FROM that does not exist or an ADAPTER that is no LoRA adapter for the FROM model."""
    canonical = check_name(name)
    recipe = parse_modelfile(modelfile)
    return _create(canonical, recipe, base_dir, f"line {recipe.from_line} (FROM)")


def create_from_fields(name: str, fields: Mapping[str, Any], *, base_dir: Path | None = None) -> CreatedModel:
    """Create `name` from /api/create's JSON fields (from, system, parameters, template, messages, license): the
    same model as the Modelfile that writes them; base_dir as create_model's. ModelfileError naming the field."""
    canonical = check_name(name)
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise ModelfileError(f"{unknown[0]}: not a field churon creates a model from (it takes {', '.join(FIELDS)})")
    base = fields.get("from")
    if not isinstance(base, str) or not base.strip():
        raise ModelfileError(f"from: {base!r}: the base model (a registry name, a path or a created model) is needed")
    for key in ("system", "template"):
        if fields.get(key) is not None and not isinstance(fields[key], str):
            raise ModelfileError(f"{key}: {fields[key]!r}: must be a string")
    template = fields.get("template")
    if template is not None:
        chat_template(template, "template")  # its errors named by the field
    try:
        parameters = check_options(fields.get("parameters") or {}, "parameters")
    except ValueError as e:
        raise ModelfileError(str(e)) from None
    recipe = Modelfile(from_=base.strip(), system=fields.get("system"), parameters=parameters, template=template,
                       messages=_messages(fields.get("messages")), license=_license(fields.get("license")))
    return _create(canonical, recipe, base_dir, "from")


def _messages(messages: Any) -> list[dict] | None:
    if messages is None:
        return None
    if not isinstance(messages, list):
        raise ModelfileError(f"messages: {messages!r}: must be a list of {{role, content}} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, Mapping) else m
            raise ModelfileError(f"messages[{i}].role: {role!r}: must be one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise ModelfileError(f"messages[{i}].content: {m.get('content')!r}: must be a string")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _license(license: Any) -> str | None:
    """Ollama sends a license as a string or a list of them (a Modelfile's LICENSE lines)."""
    if license is None or isinstance(license, str):
        return license
    if isinstance(license, list) and all(isinstance(x, str) for x in license):
        return "\n\n".join(license)
    raise ModelfileError(f"license: {license!r}: must be a string or a list of strings")


def _create(name: str, recipe: Modelfile, base_dir: Path | None, where: str) -> CreatedModel:
    base_path, parent = _resolve_from(recipe.from_, base_dir, where)
    adapter = parent.adapter if parent is not None else None  # inherited, as created (its path absolute)
    if recipe.adapter is not None:
        adapter = _resolve_adapter(recipe.adapter, base_dir, f"line {recipe.adapter_line} (ADAPTER)")
    if adapter is not None:
        _check_adapter(adapter, base_path, f"line {recipe.adapter_line} (ADAPTER)" if recipe.adapter is not None
                       else f"{where}: {recipe.from_}'s ADAPTER")
    # the canonical Modelfile names the base and the adapter by their paths: it creates the same model from anywhere
    effective = replace(recipe.inherit(parent.recipe) if parent is not None else recipe, from_=str(base_path),
                        adapter=str(adapter) if adapter is not None else None)
    model = CreatedModel(
        name=name,
        base=recipe.from_,
        base_path=base_path,
        adapter=adapter,
        system=effective.system,
        parameters=effective.parameters,
        template=chat_template(effective.template, "TEMPLATE") if effective.template is not None else None,
        messages=list(effective.messages or []),
        license=effective.license,
        modelfile=effective.text(),
        created_at=time.time(),
    )
    _write(model)
    return model


def _resolve_from(base: str, base_dir: Path | None, where: str) -> tuple[Path, CreatedModel | None]:
    """FROM as Ollama resolves it: an existing path first, then a created model, then a registry name. Without a
    base_dir, the "path" is only a file or directory of the model cache, by its name (.gguf left out or not)."""
    from churon.loader import open_model  # the loader pulls in torch: only when a model is created

    path = _local_path(base, base_dir)
    if path.exists():
        try:
            open_model(path, pull=False)
        except ChuronError as e:
            raise ModelfileError(f"{where}: {base}: not a model churon can load: {e}") from None
        return path.resolve(), None
    parent = get_model(base)
    if parent is not None:
        return parent.base_path, parent
    if registry_entry(base) is not None:
        try:
            return resolve_model(base, pull=True), None
        except ChuronError as e:
            raise ModelfileError(f"{where}: {base}: {e}") from None
    what = "a file or directory" if base_dir is not None else "a model in the server's cache"
    raise ModelfileError(f"{where}: {base} does not exist: not {what} ({path}), a created model or a"
                         f" registry model (known: {', '.join(sorted(REGISTRY))})")


def _local_path(value: str, base_dir: Path | None) -> Path:
    """The path a Modelfile's FROM or ADAPTER names, relative to base_dir; without a base_dir only a file or
    directory of the model cache, by its name (.gguf left out or not). It may not exist."""
    if base_dir is None:
        named = "/" not in value and "\\" not in value and ".." not in value  # a name, never a path out of the cache
        cached = [models_dir() / value, models_dir() / f"{value}.gguf"] if named else []
        return next((p for p in cached if p.exists()), models_dir() / "NAME")
    path = Path(value).expanduser()
    return path if path.is_absolute() else base_dir / path


def _resolve_adapter(adapter: str, base_dir: Path | None, where: str) -> Path:
    """ADAPTER's path, as FROM's: relative to the Modelfile's folder; over HTTP a name in the model cache only."""
    path = _local_path(adapter, base_dir)
    if not path.exists():
        what = ("a file or directory" if base_dir is not None else
                "an adapter in the server's cache (over HTTP a Modelfile has no folder: a client does not open files"
                " on the server)")
        raise ModelfileError(f"{where}: {adapter} does not exist: not {what} ({path})")
    return path.resolve()


def _check_adapter(adapter: Path, base_path: Path, where: str) -> None:
    """The adapter read against the base model's config now: another model's adapter is the create's error."""
    from churon.config import EncoderConfig
    from churon.formats.lora import read_lora
    from churon.loader import open_model

    config = open_model(base_path, pull=False).config
    if isinstance(config, EncoderConfig):
        raise ModelfileError(f"{where}: {base_path} is an embedding model; LoRA adapters are for text generation")
    try:
        read_lora(adapter, config)
    except ChuronError as e:  # names the file and the tensor
        raise ModelfileError(f"{where}: not a LoRA adapter for {base_path}: {e}") from None


def resolve(name: str) -> tuple[Path, CreatedModel | None]:
    """What a model name loads: a created model -> (its base_path, it); any other name or path -> (the registry's
    cached file or the path, None). ChuronError if there is nothing to load."""
    model = get_model(name)
    if model is None:
        return resolve_model(name, pull=False), None
    if not model.base_path.exists():
        raise ChuronError(f"{model.name}: its base model {model.base_path} (FROM {model.base}) no longer exists")
    if model.adapter is not None and not model.adapter.exists():
        raise ChuronError(f"{model.name}: its LoRA adapter {model.adapter} (ADAPTER) no longer exists")
    return model.base_path, model


def remove_model(name: str) -> None:
    canonical = check_name(name)
    path = _manifest_path(canonical)
    if not path.is_file():
        raise ModelNotFoundError(f"{name}: no created model of this name (`churon list` shows them)")
    path.unlink()
    root = manifests_dir().resolve()
    for folder in path.parents:  # the folders a name's parts made, now empty
        if folder == root or any(folder.iterdir()):
            break
        folder.rmdir()


def copy_model(src: str, dst: str) -> CreatedModel:
    """dst, a created model: a copy of src if src is one, else a model FROM src (a registry name, a path) with
    nothing changed."""
    target = check_name(dst)
    model = get_model(src)
    if model is None:
        return create_from_fields(target, {"from": src}, base_dir=Path.cwd())
    copy = CreatedModel(**{**asdict(model), "name": target, "created_at": time.time()})
    _write(copy)
    return copy


def _write(model: CreatedModel) -> None:
    """The manifest, replaced in one rename: a reader sees the old one or the new one, never half of one."""
    path = _manifest_path(model.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {**asdict(model), "base_path": str(model.base_path),
              "adapter": str(model.adapter) if model.adapter is not None else None}
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.stem}.", suffix=".part", delete=False,
                                     encoding="utf-8") as f:
        try:
            json.dump(record, f, indent=2)
            f.write("\n")
        except BaseException:
            os.unlink(f.name)
            raise
    os.replace(f.name, path)


def _read(path: Path) -> CreatedModel:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        record["base_path"] = Path(record["base_path"])
        if record.get("adapter") is not None:  # a manifest written before ADAPTER has none
            record["adapter"] = Path(record["adapter"])
        return CreatedModel(**record)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ChuronError(f"{path}: not a readable created-model manifest ({type(e).__name__}: {e})") from None
