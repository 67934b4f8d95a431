"""Resolve `--model`, build the model skeleton on the meta device, read safetensors tensors
(cli.layout maps their names to the model's parameters)."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from ..offload.core.errors import TierwiseError
from . import tensorfile
from .profilemodel import is_profile

log = logging.getLogger(__name__)


class ModelError(TierwiseError):
    """`--model` names nothing usable."""


@dataclass(kw_only=True)
class ModelSource:
    """What `--model` resolved to."""

    name: str                   # as given, or "builtin-tiny"
    config: Any                 # a transformers PretrainedConfig
    tokenizer: Any              # a PreTrainedTokenizer(Fast); None where not asked for
    model_dir: Path | None      # a local HF dir with weights, or None (random init)
    generation_config: Path | None = None
    note: str | None = None     # a warning the CLI shows loudly (e.g. random init)

    @property
    def has_weights(self) -> bool:
        return self.model_dir is not None

    @functools.cached_property
    def digest(self) -> str | None:
        """weights_digest of its weights (read once a run), None without any."""
        return weights_digest(self.model_dir) if self.model_dir is not None else None


def build_meta_model(config) -> torch.nn.Module:
    """The model `finetune` trains, on the meta device, ties tied (offload.engine.model_info.hf_meta_model),
    its packed rows attended per segment where it keeps them apart (packing.use_segments).

    A config with `auto_map` exists only when the user gave --trust-remote-code (resolve_model
    refuses it otherwise), so its model class is the model's own code."""
    from ..offload.engine.model_info import hf_meta_model
    from .packing import use_segments

    model = hf_meta_model(config, trust_remote_code=bool(getattr(config, "auto_map", None)))
    use_segments(model)
    return model


def safetensors_files(model_dir: "str | Path") -> list[Path]:
    """The weight files of a HF dir, in index order; ModelError when there are none."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in dict.fromkeys(weight_map.values())]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise ModelError(f"{model_dir}: no .safetensors weights (convert .bin checkpoints "
                         "with transformers' save_pretrained(safe_serialization=True))")
    return found


_ST_DTYPES = tensorfile.DTYPES


def _safetensors_header(path: Path) -> tuple[int, dict]:
    """(offset of the data section, {name: entry}) from a .safetensors header."""
    import struct

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ModelError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        size = os.fstat(f.fileno()).st_size
        if n > size - 8:  # never allocate what a corrupt length asks for
            raise ModelError(f"{path}: corrupt safetensors header (it claims {n} bytes, the file "
                             f"has {size})")
        try:
            meta = json.loads(f.read(n))
        except ValueError as exc:
            raise ModelError(f"{path}: corrupt safetensors header ({exc})") from None
        if not isinstance(meta, dict):
            raise ModelError(f"{path}: corrupt safetensors header (not a JSON object)")
    meta.pop("__metadata__", None)
    return 8 + n, meta


def read_safetensors_index(model_dir: "str | Path") -> dict[str, tuple[Path, int, dict]]:
    """{tensor name: (file, data offset, header entry)} over every weight file (headers only)."""
    index = {}
    for path in safetensors_files(model_dir):
        base, meta = _safetensors_header(path)
        for name, entry in meta.items():
            if name in index:
                raise ModelError(f"{path}: tensor {name!r} is also in {index[name][0].name}")
            index[name] = (path, base, entry)
    return index


def weights_digest(model_dir: "str | Path") -> str:
    """A fingerprint of the weights in `model_dir`: each tensor's name, dtype, shape and first
    4 KiB (a fine-tune changes nearly every element of a tensor it touches), in name order, so
    the same weights saved in other shards give the same one. It reads a few KiB a tensor, not
    the weights: for a LoRA --resume, whose checkpoint holds the adapters only."""
    index = read_safetensors_index(model_dir)
    crc, files = 0, {}
    try:
        for name in sorted(index):
            path, base, entry = index[name]
            f = files[path] if path in files else files.setdefault(path, open(path, "rb"))
            start, end = entry["data_offsets"]
            f.seek(base + start)
            crc = zlib.crc32(json.dumps([name, entry["dtype"], entry["shape"]]).encode(), crc)
            crc = zlib.crc32(f.read(min(end - start, 4096)), crc)
    finally:
        for f in files.values():
            f.close()
    return f"{len(index)} tensors, crc32 {crc:08x}"


def read_tensor(f: Any, base: int, name: str, entry: dict, path: Path) -> torch.Tensor:
    """One tensor of an open safetensors file, read into its own buffer."""
    dtype = _ST_DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ModelError(f"{path}: tensor {name!r} has unsupported dtype {entry['dtype']}")
    begin, end = entry["data_offsets"]
    buf = torch.empty(end - begin, dtype=torch.uint8)
    f.seek(base + begin)
    if f.readinto(memoryview(buf.numpy())) != end - begin:
        raise ModelError(f"{path}: truncated while reading {name!r}")
    return buf.view(dtype).reshape(entry["shape"])


def iter_safetensors(model_dir: "str | Path", *, order: Sequence[str] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) one at a time, each read with plain file reads into its own buffer, under
    the names on disk (cli.layout.iter_checkpoint maps them to the model's parameters).

    Not memory-mapped on purpose: the pages of a mapped shard count in the process's RSS until
    the shard is closed, which would put a whole shard above the host budget; here only the
    tensor being copied into its chunk is in memory. Without `order`: shard by shard, in file
    order. With `order`: exactly those names in that order; a missing name is a ModelError.
    """
    index = read_safetensors_index(model_dir)
    names = order if order is not None else list(index)
    handles: dict[Path, Any] = {}
    try:
        for name in names:
            if name not in index:
                raise ModelError(f"{model_dir}: checkpoint has no tensor named {name!r}")
            path, base, entry = index[name]
            if path not in handles:
                handles[path] = open(path, "rb")
            yield name, read_tensor(handles[path], base, name, entry, path)
    finally:
        for f in handles.values():
            f.close()


def resolve_model(spec: str | None, *, trust_remote_code: bool = False, tokenizer: bool = True,
                  hub: "dict[str, Any] | None" = None) -> ModelSource:
    """A local HF dir (has config.json), a model profile name, or None for the built-in tiny.
    `hub`: snapshot_download's revision / token for a Hub id.

    A directory whose config.json has `auto_map` ships its own Python code: it is run only with
    `trust_remote_code` (--trust-remote-code), else refused; transformers never prompts.
    `tokenizer=False`: a directory's tokenizer is not loaded (nor needed: the model alone)."""
    if spec is None:
        from .builtin import build_tokenizer, tiny_llama_config

        tok = build_tokenizer()
        return ModelSource(name="builtin-tiny", config=tiny_llama_config(tokenizer=tok),
                           tokenizer=tok, model_dir=None)
    path = Path(spec).expanduser()
    if path.is_dir():
        return _from_dir(path, trust_remote_code=trust_remote_code, tokenizer=tokenizer)
    if is_profile(spec):  # a profile name, or a profile given as a .toml file
        return _from_profile(spec)
    if HUB_ID.fullmatch(spec):
        source = _from_dir(hub_snapshot(spec, **(hub or {})), trust_remote_code=trust_remote_code,
                           tokenizer=tokenizer)
        return dataclasses.replace(source, name=spec)
    raise ModelError(f"--model {spec}: not a Hugging Face model directory "
                     "(expected a directory with config.json), a Hub id (ORG/NAME) or a model profile")


#: A Hugging Face Hub model id: ORG/NAME (a path that exists is taken as a directory first).
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
#: What a run reads of a Hub snapshot: config, tokenizer and safetensors weights (never .bin).
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def hub_snapshot(repo_id: str, **hub: Any) -> Path:
    """The local directory of Hub model `repo_id`: the Hugging Face cache's snapshot when it is
    there (no network), else downloaded into that cache with huggingface_hub's progress bars
    (refused when HF_HUB_OFFLINE is set). HF_HUB_CACHE / HF_HOME are read now, not at import."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cache = os.environ.get("HF_HUB_CACHE") or (os.path.join(os.environ["HF_HOME"], "hub")
                                               if os.environ.get("HF_HOME") else None)
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, allow_patterns=HUB_FILES, local_files_only=True,
                                      **hub))
    except LocalEntryNotFoundError:
        if _offline():
            raise ModelError(f"--model {repo_id}: not in the local Hugging Face cache, and HF_HUB_OFFLINE is "
                             "set: download it once online (or give its directory)") from None
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, allow_patterns=HUB_FILES, **hub))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as e:
        raise ModelError(f"--model {repo_id}: no such directory here, and not a model the Hugging Face Hub "
                         f"gave ({_first_line(e)})") from None


def _from_dir(path: Path, *, trust_remote_code: bool = False, tokenizer: bool = True) -> ModelSource:
    from transformers import AutoConfig, AutoTokenizer

    if not (path / "config.json").exists():
        raise ModelError(f"--model {path}: no config.json in this directory")
    raw = _config_json(path / "config.json")
    if "auto_map" in raw and not trust_remote_code:  # never transformers' "run the custom code? [y/N]"
        raise ModelError(f"--model {path}: this model ships its own Python code (auto_map in "
                         "config.json): add --trust-remote-code to run it (read it first)")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as e:
        kind = raw.get("model_type")
        why = (f"unknown model_type {kind!r} (this transformers does not implement it)"
               if isinstance(kind, str) and "model type" in str(e) else _first_line(e))
        raise ModelError(f"--model {path}: cannot read config.json: {why}") from None
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code) if tokenizer else None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelError(f"--model {path}: cannot load its tokenizer ({_first_line(e)})") from None
    read_safetensors_index(path)  # fail early: no weights, a corrupt header
    gen = path / "generation_config.json"
    return ModelSource(name=str(path), config=config, tokenizer=tok, model_dir=path,
                       generation_config=gen if gen.exists() else None)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _config_json(path: Path) -> dict:
    """config.json as a dict, or a one-line ModelError (empty, not JSON, not an object)."""
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ModelError(f"{path}: not a text file") from None
    except ValueError as e:
        raise ModelError(f"{path}: not valid JSON ({_first_line(e)})" if path.stat().st_size
                         else f"{path}: empty file") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _from_profile(name: str) -> ModelSource:
    from ..profiles import load_model_profile
    from ..profiles.schema import UnknownProfileError

    try:
        profile = load_model_profile(name)
    except UnknownProfileError as e:  # perhaps a directory meant: say where a relative path starts
        if name.endswith(".toml"):
            raise
        raise ModelError(f"--model {name}: no such directory in {Path.cwd()} (a relative path, in a --config "
                         f"file too, starts from the current directory), not a Hub id (ORG/NAME), and {e}") from None
    from .builtin import build_tokenizer

    tokenizer, config = build_tokenizer(), profile.to_hf_config()
    text = config.get_text_config()  # (a vision model's text model's)
    if len(tokenizer) > text.vocab_size:  # e.g. the 256-token `tiny` profile
        log.info("model profile %s: vocab_size %d -> %d to fit the built-in tokenizer",
                 name, text.vocab_size, len(tokenizer))
        text.vocab_size = len(tokenizer)
    return ModelSource(
        name=name, config=config, tokenizer=tokenizer, model_dir=None,
        note=(f"model profile '{name}' has no weights: training a RANDOMLY INITIALISED model "
              "with the built-in tiny tokenizer (pass a Hugging Face model directory to "
              "fine-tune real weights)"),
    )


def count_parameters(model: torch.nn.Module) -> int:
    """Parameters of `model` (tied weights counted once); works on the meta device."""
    return sum(p.numel() for p in model.parameters())
