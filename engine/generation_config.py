"""Sampling defaults from a model's `generation_config.json`, as vLLM applies them.

`--generation-config auto` (the default) reads the model folder's file, `vllm` reads none,
any other value is a folder to read it from; `--override-generation-config` adds to or
replaces what was read (a JSON `null` removes a key). Only the keys vLLM takes count:
`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` and `max_new_tokens`
(`max_tokens` here). A request's own value always wins over a default.

The router (every front door), the cluster's start-up checks and the offline `LLM` all read
defaults through this module, so the keys, their mapping and the checks live here alone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.sampling_params import SamplingParams

FILE_NAME = "generation_config.json"
# generation_config.json's keys -> SamplingParams fields (Hugging Face's max_new_tokens is
# vLLM's max_tokens).
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
SOURCE_FLAG = "--generation-config"
OVERRIDE_FLAG = "--override-generation-config"


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling defaults in force and where they came from.

    Args:
        source: `auto`, `vllm` or the folder given as `--generation-config`.
        file: the `generation_config.json` read; None when none was.
        defaults: SamplingParams field -> value, for the fields a request omits.
        override: `--override-generation-config` as given (its own key names).
    """

    source: str = "vllm"
    file: str | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    override: Mapping[str, Any] = field(default_factory=dict)

    def apply(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """`params` with each default filled in where the field is missing or None.

        Args:
            params: SamplingParams fields as a request set them (None: omitted).

        Returns:
            A new dict; the request's own values are kept.
        """
        filled = dict(params)
        for name, value in self.defaults.items():
            if filled.get(name) is None:
                filled[name] = value
        return filled

    def sampling_params(self) -> SamplingParams:
        """SamplingParams with these defaults (vLLM's `LLM.get_default_sampling_params`)."""
        return SamplingParams(**self.defaults)

    def status(self) -> dict[str, Any]:
        """What `status` shows: source, file, the defaults in force and the override."""
        return {"source": self.source, "file": self.file, "defaults": dict(self.defaults),
                "override": dict(self.override)}


def parse_generation_override(text: str | None) -> dict[str, Any]:
    """`--override-generation-config` JSON text as a checked mapping.

    Args:
        text: a JSON object of generation_config.json keys; None or empty for none.

    Returns:
        The object (its own key names; a null value removes a key read from the file).

    Raises:
        ValueError: not JSON, not an object, an unknown key or a value out of range; the
            message names the flag.
    """
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{OVERRIDE_FLAG}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{OVERRIDE_FLAG}: expected a JSON object such as "
                         f"'{{\"temperature\": 0.5}}', got {type(value).__name__}")
    _check_override(value)
    return value


def check_generation_config(generation_config: str,
                            override: Mapping[str, Any] | None = None) -> None:
    """The start-up check of both flags that needs no model: `generation_config` is `auto`,
    `vllm` or a folder holding a valid generation_config.json, and `override` is valid.

    Raises:
        ValueError: the message names the flag.
    """
    if generation_config not in ("auto", "vllm"):
        _read(_folder_file(generation_config))
    _check_override(override or {})


def _check_override(override: Mapping[str, Any]) -> None:
    unknown = sorted(set(override) - set(KEYS))
    if unknown:
        raise ValueError(f"{OVERRIDE_FLAG}: unknown key {unknown[0]!r}; the keys are "
                         f"{', '.join(sorted(KEYS))}")
    _check_values(override, OVERRIDE_FLAG)


def load_generation_defaults(generation_config: str = "auto",
                             model_dir: str | Path | None = None,
                             override: Mapping[str, Any] | None = None) -> GenerationDefaults:
    """The sampling defaults for a model.

    Args:
        generation_config: `auto` (the model folder's generation_config.json, if it has
            one), `vllm` (no file) or a folder whose generation_config.json to read.
        model_dir: the model's folder, for `auto`.
        override: `--override-generation-config`'s mapping, over what the file gave.

    Returns:
        The defaults (SamplingParams names) and their source.

    Raises:
        ValueError: a folder without the file, an unreadable file or a bad value, or a bad
            override; the message names the flag.
    """
    override = dict(override or {})
    _check_override(override)
    path: Path | None = None
    if generation_config == "auto":
        if model_dir is not None and (Path(model_dir) / FILE_NAME).is_file():
            path = Path(model_dir) / FILE_NAME
    elif generation_config != "vllm":
        path = _folder_file(generation_config)
    values = {**(_read(path) if path is not None else {}), **override}
    defaults = {KEYS[key]: value for key, value in values.items() if value is not None}
    return GenerationDefaults(generation_config, None if path is None else str(path),
                              defaults, override)


def _folder_file(folder: str) -> Path:
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise ValueError(f"{SOURCE_FLAG}: expected 'auto', 'vllm' or a folder holding "
                         f"{FILE_NAME}; {folder!r} is not a folder")
    if not (path / FILE_NAME).is_file():
        raise ValueError(f"{SOURCE_FLAG}: {path} has no {FILE_NAME}")
    return path / FILE_NAME


def _read(path: Path) -> dict[str, Any]:
    """The file's sampling keys (the rest, e.g. bos/eos ids, is not for sampling)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{SOURCE_FLAG}: {path}: unreadable ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{SOURCE_FLAG}: {path}: expected a JSON object, got "
                         f"{type(value).__name__}")
    sampling = {key: value[key] for key in KEYS if key in value}
    _check_values(sampling, f"{SOURCE_FLAG}: {path}")
    return sampling


def _check_values(values: Mapping[str, Any], where: str) -> None:
    """Each value checked by SamplingParams itself, so defaults and requests share one set
    of ranges; None is allowed (the key is then left out, as vLLM does)."""
    for key, value in values.items():
        if value is None:
            continue
        name = KEYS[key]
        try:
            SamplingParams(**{name: value})
        except ValueError as e:
            # The message names SamplingParams' field; the user wrote the file's key.
            raise ValueError(f"{where}: {str(e).replace(name, key, 1)}") from None
