"""`tokend serve`'s options generated from the config Structs' fields: one flag, one TOML key, one env variable each.

A field's name is its TOML key (`max_num_seqs`), its flag (`--max-num-seqs`) and its environment variable
(`TOKEND_MAX_NUM_SEQS`); its type gives the flag's parser and choices, its msgspec Meta description the help text,
and its default the "(default: ...)" shown there. Nothing here is written per option, so a field added to
EngineConfig is a flag the day it exists.
"""

from __future__ import annotations

import argparse
import enum
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec

ENV_PREFIX = "TOKEND_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True, slots=True)
class Option:
    """One option: a struct field seen as a flag, a TOML key and an environment variable."""

    key: str  # the field's name: the TOML key
    kind: type  # int, float, bool, str or a str enum: what a flag's or variable's text is parsed into
    nullable: bool  # None (unset) is a valid value
    many: bool  # a list (`model`): the flag repeats, the TOML value may be a list
    choices: tuple[str, ...] | None  # a Literal's or an enum's values
    description: str
    default: object

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.key.upper()

    def parse(self, text: str) -> object:
        """The value of a flag's or environment variable's text; ValueError naming the key when it is not one."""
        value = text.strip()
        if self.many:
            return [value]
        if self.kind is bool:
            if value.lower() not in _TRUE + _FALSE:
                raise ValueError(f"{self.key}: must be true or false, got {text!r}")
            return value.lower() in _TRUE
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{self.key}: must be one of {'|'.join(self.choices)}, got {text!r}")
        try:
            return self.kind(value)
        except ValueError:
            raise ValueError(f"{self.key}: must be {_KIND_NAMES[self.kind]}, got {text!r}") from None


_KIND_NAMES = {int: "an integer", float: "a number", str: "a string"}


def options_of(struct_type: type[msgspec.Struct], skip: frozenset[str] = frozenset()) -> list[Option]:
    """An Option for every field of `struct_type` but those in `skip`, in declaration order."""
    return [_option(field) for field in msgspec.structs.fields(struct_type) if field.name not in skip]


def _option(field: msgspec.structs.FieldInfo) -> Option:
    annotation, description = field.type, ""
    if typing.get_origin(annotation) is Annotated:
        annotation, *extras = typing.get_args(annotation)
        description = next((m.description for m in extras if isinstance(m, msgspec.Meta) and m.description), "")
    nullable = False
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        nullable, (annotation,) = True, members
    many = typing.get_origin(annotation) in (tuple, list)
    if many:
        annotation = typing.get_args(annotation)[0]
    choices = None
    if typing.get_origin(annotation) is Literal:
        choices = tuple(typing.get_args(annotation))
        annotation = type(choices[0])
    elif isinstance(annotation, type) and issubclass(annotation, enum.StrEnum):
        choices = tuple(member.value for member in annotation)  # parsed into the member by the enum itself
    if annotation not in (int, float, bool, str) and choices is None:
        raise TypeError(f"{field.name}: {annotation!r} cannot be a flag")  # a programming error, caught by tests
    default = field.default if field.default_factory is msgspec.NODEFAULT else field.default_factory()
    return Option(field.name, annotation, nullable, many, choices, description, default)


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, options: list[Option]) -> None:
    """One flag per option. Unset flags stay None, so that the environment, the TOML file and the defaults show
    through; the help shows the default the struct would take."""
    for option in options:
        kwargs: dict[str, object] = {"dest": option.key, "default": None, "help": _help(option)}
        if option.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif option.many:
            kwargs.update(action="append", metavar=option.key.upper())
        else:  # parsed by Option.parse, not argparse, so that a bad value exits 78 naming its key like any other
            kwargs["metavar"] = _metavar(option)
        parser.add_argument(option.flag, **kwargs)


def from_env(options: list[Option], environ: typing.Mapping[str, str]) -> dict[str, object]:
    """The options set by TOKEND_<KEY> variables; an empty variable counts as unset."""
    values = {}
    for option in options:
        text = environ.get(option.env_var, "")
        if text.strip():
            try:
                values[option.key] = option.parse(text)
            except ValueError as error:
                raise ValueError(f"{error} (from {option.env_var})") from None
    return values


def from_flags(options: list[Option], args: argparse.Namespace) -> dict[str, object]:
    """The options given as flags, their text parsed."""
    given = {o: getattr(args, o.key, None) for o in options}
    return {o.key: o.parse(v) if isinstance(v, str) else v for o, v in given.items() if v is not None}


def _help(option: Option) -> str:
    default = option.default
    if default is None or default == ():
        shown = "unset"
    elif isinstance(default, bool):
        shown = str(default).lower()
    else:
        shown = str(default)
    return f"{option.description} (default: {shown})".replace("%", "%%")  # argparse %-formats help


def _metavar(option: Option) -> str | None:
    if option.choices is not None:
        return "{" + ",".join(option.choices) + "}"
    return {int: "N", float: "X"}.get(option.kind, option.key.upper())
