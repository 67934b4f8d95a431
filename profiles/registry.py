"""Find, read and validate profile TOML files: by name, alias (case-insensitive) or path."""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path
from typing import Any

from .hardware import HardwareProfile
from .model import ModelProfile
from .schema import FieldTypeError, ProfileError, UnknownProfileError, from_table

log = logging.getLogger(__name__)

PROFILE_ROOT = Path(__file__).resolve().parent
_KINDS = {"model": ("models", ModelProfile), "hardware": ("hardware", HardwareProfile)}


def _display(path: Path) -> str:
    """A short path for messages: relative to the package's parent when inside it."""
    try:
        return str(path.resolve().relative_to(PROFILE_ROOT.parent))
    except ValueError:
        return str(path)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ProfileError(f"{_display(path)}: no such profile file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{_display(path)}: not valid TOML ({exc})") from None


def _names(table: dict[str, Any]) -> list[str]:
    names = [table.get("name")] + list(table.get("aliases", []) if isinstance(table.get("aliases"), list) else [])
    return [n.lower() for n in names if isinstance(n, str)]


def _index(kind: str) -> dict[str, Path]:
    """Every known name and alias (lower case) -> its file, for one kind of profile."""
    index: dict[str, Path] = {}
    for path in sorted((PROFILE_ROOT / _KINDS[kind][0]).glob("*.toml")):
        for n in [path.stem.lower()] + _names(_read_toml(path)):
            other = index.setdefault(n, path)
            if other != path:
                raise ProfileError(f"{_display(path)}: name '{n}' is also used by {_display(other)}")
    return index


def known_profiles(kind: str) -> list[str]:
    """Canonical file stems of the shipped profiles of `kind` ("model" or "hardware")."""
    return sorted(p.stem for p in (PROFILE_ROOT / _KINDS[kind][0]).glob("*.toml"))


def _resolve(kind: str, name_or_path: str | Path) -> Path:
    text = str(name_or_path)
    if text.endswith(".toml") or Path(text).is_file():  # "org/name" is a name, not a path
        return Path(text)
    path = _index(kind).get(text.strip().lower())
    if path is None:
        raise UnknownProfileError(
            f"unknown {kind} profile '{text}' (known: {', '.join(known_profiles(kind))}; or pass a path to a .toml)")
    return path


def _raw_hardware(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The hardware table of `path` with its `extends` chain merged in (one level of tables deep)."""
    table = _read_toml(path)
    base_name = table.get("extends")
    if base_name is None:
        return table
    if not isinstance(base_name, str):
        raise FieldTypeError(f"field 'extends' must be a string, got {base_name!r}", where=_display(path),
                             field="extends")
    base_path = _resolve("hardware", base_name)
    if base_path.resolve() in seen + (path.resolve(),):
        raise ProfileError(f"{_display(path)}: 'extends' chain loops back to {_display(base_path)}")
    merged = _raw_hardware(base_path, seen + (path.resolve(),))
    for key in ("name", "aliases", "description"):
        merged.pop(key, None)
    for key, value in table.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def load_model_profile(name_or_path: str | Path) -> ModelProfile:
    """A model profile by name ("7b", "Llama-2-7B", "meta-llama/Llama-2-7b-hf") or .toml path."""
    path = _resolve("model", name_or_path)
    profile = from_table(ModelProfile, _read_toml(path), where=_display(path))
    log.debug("model profile %s from %s", profile.name, path)
    return profile


def load_hardware_profile(name_or_path: str | Path) -> HardwareProfile:
    """A hardware profile by name ("rtx4090", "H100") or .toml path; `extends` is resolved."""
    path = _resolve("hardware", name_or_path)
    profile = from_table(HardwareProfile, _raw_hardware(path), where=_display(path))
    log.debug("hardware profile %s from %s", profile.name, path)
    return profile
