"""`--config FILE`: a command's flags read from a YAML or JSON mapping, turned into argv tokens placed before the
real command line (which overrides them) so that argparse's own types and checks apply; `write_config` writes one."""

from __future__ import annotations

import argparse
import difflib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

SUFFIXES = (".json", ".yaml", ".yml")


class ConfigFileError(ValueError):
    """A config file that cannot be read, or a key or value its command does not take; the message names the file
    (and the key) in one line."""


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    """Give a command `--config FILE` (main expands it with `expand_argv` before parsing)."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="this command's flags from a YAML or JSON file (.yaml, .yml, .json), a mapping such as "
        "{max-num-seqs: 64, enforce-eager: true}; flags on the command line override it",
    )


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The mapping a config file holds (an empty YAML file: none)."""
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIXES:
        raise ConfigFileError(f"{path}: a config file is .json, .yaml or .yml, not {suffix or 'without a suffix'}")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigFileError(f"{path}: cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigFileError(f"{path}: not UTF-8 text") from None
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigFileError(f"{path}: not valid JSON: {e}") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
            raise ConfigFileError(f"{path}: not valid YAML: {e.problem or e.context}{where}") from None
        except yaml.YAMLError as e:
            raise ConfigFileError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
        if data is None:
            data = {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: holds a {type(data).__name__}, not a mapping of flag names to values")
    return data


def write_config(path: str | os.PathLike, flags: Mapping[str, Any]) -> Path:
    """Write {flag name: value} (names as `config_argv` takes them) as a config file, JSON or YAML by the suffix,
    for `--config` to read back; keys are written as dashed names without the leading `--`."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ConfigFileError(f"{path}: a config file is .json, .yaml or .yml, not {suffix or 'without a suffix'}")
    data = {_flag_name(key, path): _plain(value) for key, value in flags.items()}
    if suffix == ".json":
        text = json.dumps(data, indent=2) + "\n"
    else:
        import yaml

        text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)  # a reader never sees half a file
    return path


def expand_argv(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """`argv` with the flags of its `--config FILE` (the last one given) placed before the command line's own.
    `parser` is the program's parser: when argv starts with one of its subcommands, that subcommand's parser is the
    one the file's keys are checked against. Unchanged when the command takes no --config or none is given."""
    argv = list(argv)
    command, head, rest = parser, [], argv
    sub = _subcommand(parser, argv[0]) if argv else None
    if sub is not None:
        command, head, rest = sub, argv[:1], argv[1:]
    path = _config_path(command, rest)
    if path is None:
        return argv
    return [*head, *config_argv(command, read_config(path), source=path, given=rest), *rest]


def config_argv(
    parser: argparse.ArgumentParser, flags: Mapping[Any, Any], *, source: str = "config", given: Sequence[str] = ()
) -> list[str]:
    """{flag name: value} as argv tokens for `parser`, each value checked by the flag's own type and choices.
    Names: `max-num-seqs`, `max_num_seqs` or `--max-num-seqs`. Values: a scalar; true or false for a switch (false
    leaves it off); a list for a repeatable flag; a mapping is JSON-encoded; null leaves the flag at its default.
    A repeatable flag among the command-line tokens `given` replaces the file's list. Errors name `source`."""
    table = parser._option_string_actions
    on_command_line = {_long_option(parser, token) for token in _options_part(given)}
    seen: dict[argparse.Action, str] = {}
    argv: list[str] = []
    for key, value in flags.items():
        option = "--" + _flag_name(key, source)
        action = table.get(option)
        if action is None:
            longs = [s for s in table if s.startswith("--")]
            close = difflib.get_close_matches(option, longs, n=1)
            hint = f" (did you mean {close[0][2:]}?)" if close else ""
            raise ConfigFileError(f"{source}: {key}: `{parser.prog}` takes no {option}{hint}")
        if action in seen:
            raise ConfigFileError(f"{source}: {key}: the same flag as {seen[action]}")
        seen[action] = key
        if action.dest == "config" or isinstance(action, _UNSETTABLE) or not action.option_strings:
            raise ConfigFileError(f"{source}: {key}: cannot be set in a config file")
        if value is None or (isinstance(action, argparse._AppendAction) and action in on_command_line):
            continue
        argv += _tokens(parser, action, option, value, f"{source}: {key}")
    return argv


_UNSETTABLE = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def _tokens(parser: argparse.ArgumentParser, action: argparse.Action, option: str, value: Any, where: str) -> list:
    if action.nargs == 0:  # store_true, store_false, store_const, count: a switch
        if not isinstance(value, bool):
            raise ConfigFileError(f"{where}: {option} is a switch: give true or false, not {value!r}")
        return [option] if value else []
    repeatable = isinstance(action, (argparse._AppendAction, argparse._ExtendAction))
    many = action.nargs in ("+", "*") or isinstance(action.nargs, int)
    if isinstance(value, (list, tuple)):
        if not (repeatable or many):
            raise ConfigFileError(f"{where}: {option} takes one value, not a list")
        items = [_text(v, option, where) for v in value]
    else:
        items = [_text(value, option, where)]
    if many:  # one option, its values after it
        groups = [items]
    else:
        groups = [[item] for item in items]
    tokens = []
    for group in groups:
        try:
            parser._get_values(action, group)  # argparse's own type conversion and choices check
        except argparse.ArgumentError as e:
            raise ConfigFileError(f"{where}: {e.message}") from None
        # --flag=value: a value that starts with a dash is still this flag's
        tokens += [f"{option}={group[0]}"] if len(group) == 1 and not many else [option, *group]
    return tokens


def _text(value: Any, option: str, where: str) -> str:
    if isinstance(value, bool):
        raise ConfigFileError(f"{where}: {option} takes a value, not {str(value).lower()} (quote it for the string)")
    if isinstance(value, Mapping):
        return json.dumps(value)
    if isinstance(value, (list, tuple)) or value is None:
        raise ConfigFileError(f"{where}: {option} takes a value, not {json.dumps(value)}")
    return str(value)


def _flag_name(key: Any, source: Any) -> str:
    if not isinstance(key, str) or not key.strip("-"):
        raise ConfigFileError(f"{source}: {key!r}: a key is a flag's name, such as max-num-seqs")
    return key.lstrip("-").replace("_", "-")


def _plain(value: Any) -> Any:
    """A value as JSON and safe YAML write it: tuples as lists, paths as strings."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(name)
    return None


def _options_part(argv: Sequence[str]) -> list[str]:
    """The tokens before a `--` (after it, everything is positional)."""
    argv = list(argv)
    return argv[: argv.index("--")] if "--" in argv else argv


def _long_option(parser: argparse.ArgumentParser, token: str) -> argparse.Action | None:
    """The action a `--name` or `--name=value` token selects, by argparse's rule: an exact name, else (abbreviations
    allowed) the one option the name begins."""
    if not token.startswith("--") or token == "--":
        return None
    table = parser._option_string_actions
    name = token.split("=", 1)[0]
    if name in table:
        return table[name]
    if parser.allow_abbrev:
        hits = {action for option, action in table.items() if option.startswith("--") and option.startswith(name)}
        if len(hits) == 1:
            return hits.pop()
    return None


def _config_path(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str | None:
    """The value of the last --config in argv (None when the command takes none, or argv gives none)."""
    config = parser._option_string_actions.get("--config")
    if config is None:
        return None
    tokens = _options_part(argv)
    path = None
    for i, token in enumerate(tokens):
        if _long_option(parser, token) is not config:
            continue
        if "=" in token:
            path = token.split("=", 1)[1]
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("-"):
            path = tokens[i + 1]
        else:  # argparse answers the missing value
            return None
    return path
