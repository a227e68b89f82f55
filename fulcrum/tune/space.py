"""The knobs tune turns: one serving configuration as the flags it changes from the defaults, rendered as
`fulcrum serve` arguments, as a config file's mapping, or into another engine's `--serve-cmd` template."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field

from fulcrum.defaults import DEFAULT_MAX_NUM_SEQS

# knob: (fulcrum serve's flag, its default). A knob whose default is None or False adds no flag when unset.
KNOBS: dict[str, tuple[str, object]] = {
    "max_num_seqs": ("--max-num-seqs", DEFAULT_MAX_NUM_SEQS),
    # None: `fulcrum serve`'s own for the device (defaults.serve_max_num_batched_tokens), which tune's servers take
    "max_num_batched_tokens": ("--max-num-batched-tokens", None),
    "kv_cache_memory": ("--kv-cache-memory", None),  # GiB
    "no_prefix_caching": ("--no-prefix-caching", False),
    "cpu_threads": ("--cpu-threads", None),
    "quantization": ("--quantization", None),
    "kv_cache_dtype": ("--kv-cache-dtype", "auto"),
    "tensor_parallel_size": ("--tensor-parallel-size", 1),
    "pipeline_parallel_size": ("--pipeline-parallel-size", 1),
    "data_parallel_size": ("--data-parallel-size", 1),
    "speculative_config": ("--speculative-config", None),  # a dict, JSON on the command line
    "kv_role": ("--kv-role", None),
    "cpu_bind": ("--cpu-bind", "auto"),
}
SWITCHES = {k for k, (_, default) in KNOBS.items() if default is False}  # on or off: no value to fill in
PLACEHOLDER = re.compile(r"\{(\w+)(?::([^}]*))?\}")
FIXED_PLACEHOLDERS = ("port", "model", "host")


@dataclass(frozen=True)
class Config:
    """A serving configuration: the knobs set away from their defaults (`changes`), and how many engines of it
    run side by side for P/D (`pd`: a prefill and a decode engine behind the router)."""

    changes: dict = field(default_factory=dict)
    pd: bool = False

    def __post_init__(self):
        unknown = set(self.changes) - set(KNOBS)
        if unknown:
            raise ValueError(f"unknown knob(s): {', '.join(sorted(unknown))}")

    def with_(self, **changes) -> Config:
        merged = {**self.changes, **changes}
        return Config({k: v for k, v in merged.items() if v != KNOBS[k][1]}, self.pd)

    def get(self, knob: str):
        return self.changes.get(knob, KNOBS[knob][1])

    def engines(self) -> int:
        return 2 if self.pd else 1

    def describe(self) -> str:
        if not self.changes and not self.pd:
            return "defaults"
        parts = [
            f"{KNOBS[k][0][2:]}={_plain(v)}" if v is not True else KNOBS[k][0][2:] for k, v in self.changes.items()
        ]
        return " ".join(parts + (["P/D (1 prefill + 1 decode engine)"] if self.pd else []))

    def serve_args(self) -> list[str]:
        """The `fulcrum serve` flags of the changes, in the knobs' order."""
        out = []
        for knob, (flag, _) in KNOBS.items():
            if knob not in self.changes:
                continue
            value = self.changes[knob]
            if value is True:
                out.append(flag)
            elif value not in (None, False):
                out += [flag, _plain(value)]
        return out

    def file_flags(self) -> dict:
        """The changes as a config file's mapping (flag names without dashes' prefix, as `--config` reads them)."""
        return {KNOBS[k][0][2:]: v for k, v in self.changes.items() if v is not None and v is not False}


def _plain(value) -> str:
    """A knob's value as one command-line word: JSON for a mapping, 0.5 rather than 0.50000 for a size."""
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"))
    return f"{value:g}" if isinstance(value, float) else str(value)


def template_knobs(template: str) -> set[str]:
    """The knobs a `--serve-cmd` template exposes (its placeholders, less port, model and host)."""
    names = {m.group(1) for m in PLACEHOLDER.finditer(template)}
    unknown = names - set(KNOBS) - set(FIXED_PLACEHOLDERS)
    if unknown:
        raise ValueError(
            f"--serve-cmd: unknown placeholder(s) {', '.join('{' + n + '}' for n in sorted(unknown))}; known: "
            + ", ".join("{" + n + "}" for n in (*FIXED_PLACEHOLDERS, *KNOBS))
        )
    bare = [m.group(1) for m in PLACEHOLDER.finditer(template) if m.group(1) in SWITCHES and m.group(2) is None]
    if bare:
        raise ValueError(f"--serve-cmd: {{{bare[0]}}} is a switch: write it as {{{bare[0]}:--the-flag}}, the text "
                         "that turns it on")  # fmt: skip
    if "port" not in names:
        raise ValueError("--serve-cmd needs a {port} placeholder: tune starts each server on a free port")
    return names & set(KNOBS)


def render(template: str, config: Config, port: int, model: str, host: str = "127.0.0.1") -> str:
    """The template with its placeholders filled: `{knob}` is the knob's value (its default when unset, nothing when
    that is unset too); `{knob:PREFIX}` is PREFIX followed by the value (PREFIX alone for a switch that is on),
    and nothing when the knob is unset, so the other engine keeps its own default."""
    fixed = {"port": str(port), "model": shlex.quote(model), "host": host}

    def fill(m: re.Match) -> str:
        name, prefix = m.group(1), m.group(2)
        if name in fixed:
            return fixed[name]
        value = config.changes.get(name) if prefix is not None else config.get(name)
        if value is None or value is False:
            return ""
        if value is True:
            return prefix or ""
        text = shlex.quote(_plain(value))
        return f"{prefix}{text}" if prefix is not None else text

    return PLACEHOLDER.sub(fill, template)
