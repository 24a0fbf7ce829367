"""Every config key as a ``pdserve serve`` flag, generated from the config dataclasses.

A key of the top level is ``--key-name`` (``--block-size 32``), a section's ``--section.key-name``
(``--router.request-timeout-s 60``, ``--prefill.max-num-seqs 32``, ``--planner.max-replicas
'{decode: 2}'``). A ``bool`` key is a switch (``--planner.enabled``, ``--no-planner.enabled``);
any other value is read as YAML, then checked against the key's annotation as the config file's
value is. A flag written by hand for the same key (``--kv-cache-memory``, ``--mode``) keeps its
place; ``--set KEY=VALUE`` still overrides everything.

The generated flags stay out of ``--help`` (one line says they exist); ``--help-config`` lists them.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from cluster.cluster_config import ClusterConfig, parse_value
from common.errors import ConfigError

_DEST_PREFIX = "config_key:"


@dataclass(frozen=True)
class ConfigFlag:
    key: str  # dotted: router.request_timeout_s
    hint: object  # the field's annotation
    default: object

    @property
    def flag(self) -> str:
        *sections, name = self.key.split(".")
        return "--" + ".".join([*sections, name.replace("_", "-")])

    @property
    def dest(self) -> str:
        return _DEST_PREFIX + self.key

    @property
    def is_switch(self) -> bool:
        return self.hint is bool

    @property
    def metavar(self) -> str:
        allowed = typing.get_args(self.hint) if isinstance(self.hint, types.UnionType) else (self.hint,)
        names = [_type_name(kind) for kind in allowed]
        return "|".join(dict.fromkeys(names))


def _type_name(kind: object) -> str:
    if kind is type(None):
        return "null"
    origin = typing.get_origin(kind)
    if origin is dict:
        return "MAPPING"
    if origin is list:
        return "LIST"
    return getattr(kind, "__name__", str(kind)).upper()


def config_flags(cls: type = ClusterConfig, section: str = "") -> Iterator[ConfigFlag]:
    """One flag per leaf key of ``cls``, depth first, in the dataclasses' order."""
    hints = typing.get_type_hints(cls)
    defaults = cls()
    for spec in fields(cls):
        hint, key = hints[spec.name], f"{section}{spec.name}"
        if isinstance(hint, type) and is_dataclass(hint):
            yield from config_flags(hint, key + ".")
        else:
            yield ConfigFlag(key, hint, getattr(defaults, spec.name))


def add_config_flags(parser: argparse.ArgumentParser, hand_written: Mapping[str, str]) -> list[ConfigFlag]:
    """Add a flag for every config key to ``parser`` (after its hand-written flags, whose dests map
    to keys in ``hand_written``); returns those added. A spelling the parser has already must be the
    hand-written flag of the same key."""
    added = []
    for spec in config_flags():
        taken = parser._option_string_actions.get(spec.flag)  # argparse has no public lookup
        if taken is not None:
            assert hand_written.get(taken.dest) == spec.key, f"{spec.flag} is written by hand for another key"
            continue
        if spec.is_switch:
            parser.add_argument(
                spec.flag,
                dest=spec.dest,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
            )
        else:
            parser.add_argument(
                spec.flag,
                dest=spec.dest,
                type=_value_reader(spec),
                default=argparse.SUPPRESS,
                metavar=spec.metavar,
                help=argparse.SUPPRESS,
            )
        added.append(spec)
    return added


def _value_reader(spec: ConfigFlag) -> typing.Callable[[str], object]:
    def read(text: str) -> object:
        try:
            return parse_value(text, spec.hint, spec.key, spec.flag)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    read.__name__ = spec.metavar  # argparse names the type in its error
    return read


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Dotted key -> value for the generated flags given on the command line."""
    given = vars(args)
    return {dest.removeprefix(_DEST_PREFIX): value for dest, value in given.items() if dest.startswith(_DEST_PREFIX)}


class ListConfigFlags(argparse.Action):
    """``--help-config``: every config key's flag, its type and default, then exit."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: Any = None) -> None:
        lines = []
        for spec in config_flags():
            value = f"{spec.flag}/--no-{spec.flag[2:]}" if spec.is_switch else f"{spec.flag} {spec.metavar}"
            lines.append(f"  {value:<52} (default: {spec.default!r})")
        print("every config key as a flag (the keys are documented in cluster.example.yaml):\n" + "\n".join(lines))
        parser.exit()
