"""`serve --config FILE.yaml` and the `PDCLUSTER_*` environment: more defaults for `serve`.

The file's top-level keys are `serve`'s long flag names without the dashes (`port: 8000`,
`max-num-seqs: 32`; a JSON flag such as `override-generation-config` takes a mapping or
its JSON text); its `prefill:` and `decode:` sections hold `replicas`, `resource` and
any per-worker flag, for that pool alone. Every flag also reads `PDCLUSTER_<FLAG>`
(`PDCLUSTER_MAX_NUM_SEQS=32`). The command line wins over the environment, the environment
over the file, the file over the built-in defaults; a pool's section wins over the shared
value for that pool, wherever that came from.

With `models:`, a list, one cluster serves several models: each entry names its `model`
and `served-model-name` (default: the model) and may set its own `mode`, `prefill:` and
`decode:` sections and any per-model key (`MODEL_KEYS`, the per-worker flags); an entry's
values win over the shared ones for that model, wherever those came from. Each model gets
pools of its own.

A key may be written with underscores for its dashes (`max_num_seqs: 32`), as vLLM's config
files are. The keys and their types come from the `serve` parser itself (pydantic checks them), so a
flag added there is a key of the file and an environment variable with no more code.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
import yaml

ENV_PREFIX = "PDCLUSTER_"
POOLS = ("prefill", "decode")
# `serve` flags the file holds elsewhere: pool sizes are `replicas` in the pool sections,
# and the file does not name another file.
_NOT_TOP_LEVEL = {"prefill", "decode", "config", "help"}
# What a `models:` entry may set besides the per-worker flags and its pool sections: what
# builds that model's pools and its router.
MODEL_KEYS = ("model", "served_model_name", "mode", "max_model_len", "policy",
              "local_prefill_threshold", "max_running", "max_queue", "generation_config",
              "override_generation_config")


class ConfigError(ValueError):
    """A config file or environment variable that `serve` cannot take (names where)."""


@dataclass(frozen=True)
class Layers:
    """What the file and the environment set, as `serve`'s argparse destinations.

    Args:
        defaults: shared values (file, then the environment over it).
        pools: per pool (`prefill`, `decode`), the values its section sets.
        models: with `models:`, one `Layers` per entry: what it sets over the shared
            values (its pool sizes as `prefill`/`decode`), and its pool sections.
    """

    defaults: dict[str, Any] = field(default_factory=dict)
    pools: dict[str, dict[str, Any]] = field(default_factory=dict)
    models: list[Layers] = field(default_factory=list)


def long_names(action: argparse.Action) -> list[str]:
    """The flag's long names without their dashes (`--http-port`, `--port` -> both); of a
    `--x/--no-x` flag, the `--x` ones (`negated_names` has the others)."""
    names = [s[2:] for s in action.option_strings if s.startswith("--")]
    if isinstance(action, argparse.BooleanOptionalAction):
        return [n for n in names if not n.startswith("no-")]
    return names


def negated_names(action: argparse.Action) -> list[str]:
    """Of a `--x/--no-x` flag, the `no-x` names; of any other, none."""
    if not isinstance(action, argparse.BooleanOptionalAction):
        return []
    return [s[2:] for s in action.option_strings if s.startswith("--no-")]


def _spellings(names: list[str]) -> list[str]:
    """Each name with dashes and, as vLLM's config files may write it, with underscores."""
    return list(dict.fromkeys([*names, *(n.replace("-", "_") for n in names)]))


def env_name(action: argparse.Action) -> str:
    """`--max-num-seqs` -> `PDCLUSTER_MAX_NUM_SEQS` (its first long name)."""
    return ENV_PREFIX + long_names(action)[0].upper().replace("-", "_")


# The field of a `--no-x` spelling (`--x/--no-x` flags): its value is stored negated.
_NEGATED = "negated__"


def _field_type(action: argparse.Action) -> Any:
    """The pydantic type of a flag's value: what argparse would accept (null only where
    the flag's default is None)."""
    if action.nargs == 0:  # store_true / store_false: a yes/no
        return bool
    if action.type in (int, float, Path) and action.choices is None:
        kind: Any = action.type
    else:
        kind = str if action.choices is None else Literal[tuple(action.choices)]
    if action.type not in (None, str, int, float, Path):  # a converter such as str.upper
        convert = action.type
        kind = getattr(convert, "value_type", kind)  # what it returns, where not a str
        kind = Annotated[kind, pydantic.BeforeValidator(
            lambda v: _converted(convert, v) if isinstance(v, str) else v)]
    if action.metavar == "JSON":  # a JSON object's text: the file may write the mapping
        kind = Annotated[kind, pydantic.BeforeValidator(
            lambda v: json.dumps(v) if isinstance(v, dict) else v)]
    return kind | None if action.default is None else kind


def _converted(convert: Any, value: str) -> Any:
    """`convert(value)` with argparse's refusal as pydantic's (a `ValueError`, reported
    under the file's key) instead of an exception pydantic would let through."""
    try:
        return convert(value)
    except argparse.ArgumentTypeError as e:
        raise ValueError(str(e)) from None


def _model(name: str, actions: list[argparse.Action],
           extra: Mapping[str, Any] | None = None) -> type[pydantic.BaseModel]:
    """A strict-keyed model whose fields are the flags' destinations, aliased by their long
    names with dashes or underscores (a `--no-x` spelling: a field of its own)."""
    fields: dict[str, Any] = dict(extra or {})
    for action in actions:
        alias = pydantic.AliasChoices(*_spellings(long_names(action)))
        fields[action.dest] = (_field_type(action), pydantic.Field(None, validation_alias=alias))
        if negated_names(action):
            alias = pydantic.AliasChoices(*_spellings(negated_names(action)))
            fields[_NEGATED + action.dest] = (bool | None,
                                              pydantic.Field(None, validation_alias=alias))
    return pydantic.create_model(name, __config__=pydantic.ConfigDict(extra="forbid"), **fields)


def _values(model: pydantic.BaseModel, actions: Mapping[str, argparse.Action]) -> dict[str, Any]:
    """The set fields as argparse destinations (`--no-x: true` stores False in `x`)."""
    values = model.model_dump(exclude_unset=True, exclude={*POOLS, "models"})
    out = {}
    for field_name, value in values.items():
        dest = field_name.removeprefix(_NEGATED)
        if dest not in actions:
            continue
        negated = field_name != dest or isinstance(actions[dest], argparse._StoreFalseAction)
        out[dest] = not value if negated and value is not None else value
    return out


def _error(where: str, error: pydantic.ValidationError,
           names: Mapping[str, str] | None = None) -> ConfigError:
    """One line per bad key: where, which key (`names` renames the first part), what."""
    lines = []
    for e in error.errors():
        parts = [str(part) for part in e["loc"]]
        if names and parts:
            parts[0] = names.get(parts[0], parts[0])
        if e["type"] == "extra_forbidden":
            lines.append(f"{where}: {'.'.join(parts)}: unknown key")
        else:
            lines.append(f"{where}: {'.'.join(parts)}: {e['msg']} (got {e['input']!r})")
    return ConfigError("\n".join(lines))


def layers(parser: argparse.ArgumentParser, worker_actions: list[argparse.Action],
           path: Path | None, environ: Mapping[str, str]) -> Layers:
    """Read the config file (if any) and the environment for `parser`'s flags.

    Args:
        parser: the `serve` parser.
        worker_actions: its per-worker flags: the keys a pool section may also hold.
        path: the YAML file, or None.
        environ: the environment (`PDCLUSTER_*` are read).

    Raises:
        ConfigError: an unreadable file, an unknown key or a wrong type, naming the file
            (or variable) and the key.
    """
    actions = [a for a in parser._actions if long_names(a)]
    by_dest = {a.dest: a for a in actions}
    top = [a for a in actions if a.dest not in _NOT_TOP_LEVEL]
    pool_model = _model("Pool", worker_actions, {
        "replicas": (pydantic.NonNegativeInt | None, None),
        "resource": (str | None, None)})
    pools = {pool: (pool_model | None, None) for pool in POOLS}
    entry_model = _model("Model", [by_dest[d] for d in MODEL_KEYS] + worker_actions, pools)
    file_model = _model("ConfigFile", top, {**pools, "models": (list[entry_model] | None, None)})
    result = Layers()
    if path is not None:
        parsed = _load(path, file_model)
        _read_pools(parsed, by_dest, result)
        for i, entry in enumerate(parsed.models or []):
            if entry.model is None:
                raise ConfigError(f"{path}: models.{i}.model: required")
            result.models.append(_read_pools(entry, by_dest, Layers()))
        _check_models(path, parsed)
    env_model = _model("Environment", [a for a in actions if a.dest != "help"])
    names = {env_name(a): long_names(a)[0] for a in actions if a.dest != "help"}
    names.update({ENV_PREFIX + n.upper().replace("-", "_"): n
                  for a in actions for n in negated_names(a)})
    given = {names[k]: v for k, v in environ.items() if k in names}
    try:
        result.defaults.update(_values(env_model.model_validate(given), by_dest))
    except pydantic.ValidationError as e:
        raise _error("environment", e, {flag: var for var, flag in names.items()}) from None
    return result


def _read_pools(parsed: pydantic.BaseModel, by_dest: Mapping[str, argparse.Action],
                into: Layers) -> Layers:
    """`parsed`'s values into `into.defaults`, its pool sections into `into.pools`."""
    into.defaults.update(_values(parsed, by_dest))
    for pool in POOLS:
        section = getattr(parsed, pool)
        if section is None:
            continue
        if section.replicas is not None:
            into.defaults[pool] = section.replicas
        values = _values(section, by_dest)
        if section.resource is not None:
            values["resource"] = section.resource
        into.pools[pool] = values
    return into


def _check_models(path: Path, parsed: Any) -> None:
    """`models:` names every model itself, each under a name of its own."""
    if not parsed.models:
        if parsed.models is not None:
            raise ConfigError(f"{path}: models: list at least one model")
        return
    for key in ("model", "served_model_name"):
        if getattr(parsed, key) is not None:
            raise ConfigError(f"{path}: {key.replace('_', '-')}: give it in each entry of "
                              "models:, not beside it")
    seen: dict[str, int] = {}
    for i, entry in enumerate(parsed.models):
        name = entry.served_model_name or entry.model
        if name in seen:
            raise ConfigError(f"{path}: models.{i}.served-model-name: {name!r} is already "
                              f"served by models.{seen[name]} (names must differ)")
        seen[name] = i


def _load(path: Path, model: type[pydantic.BaseModel]) -> Any:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of flag names to values, "
                          f"got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        raise _error(str(path), e) from None
