"""The gateway file: TOML, one ``[upstreams.NAME]`` table per upstream MCP server, read strictly.

A gateway file decides how much each upstream may do, so every doubt is an error: an unknown key
(a typo such as ``netwrok = false`` or ``trustd = true`` must not silently leave a default in
place), a wrong type, a relative path, a credential that does not parse, an effect or risk the
policy engine does not know. Each error names the file, the table and the key, and says what to
fix (``GatewayConfigError``). Nothing here reads a secret: credentials are specs
(``VAR=https://HOST``); their values are read from the gateway's environment when the upstream's
session is opened (gateway/upstream.py).
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from sandboxd.errors import InvalidPolicy
from sandboxd.policy.limits import MAX_ENV_NAME, MAX_ENV_VALUE, MAX_SESSION_ENV_BYTES
from sandboxd.policy.network import parse_credential
from sandboxd.policy.spec import check_command
from sandboxd.policy.tools import Effect, Risk
from sandboxd.printable import printable

UPSTREAM_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,23}")   # no "_": the first "__" of UP__tool splits
SANDBOXES = ("read-only", "workspace-write", "danger-full-access")
RISKS = (Risk.LOW, Risk.MEDIUM, Risk.HIGH)
STARTS = ("gateway", "first_use")
MAX_UPSTREAMS = 32
MAX_TOOL_OVERRIDES = 256
MAX_FILE_BYTES = 1 << 20
MAX_LIST = 256                     # entries of command, writable_roots, allow_domains, credentials, pass_env, env
MAX_TEXT = 4096                    # characters of one string of the file
MAX_TIMEOUT_SECONDS = 86400.0
DEFAULT_TIMEOUT_SECONDS = 120.0
# An upstream's own variables (env and the pass_env values) together, NAME=value bytes: the
# daemon takes 128 KiB for a call's whole environment (policy.limits.MAX_ENV_BYTES); this half
# leaves the rest for its defaults (PATH, HOME, ...), as a session's own env is bounded.
MAX_ENV_TOTAL_BYTES = MAX_SESSION_ENV_BYTES
# A variable whose name says it holds a secret (its value redacted from the audit, mcp.gateway.authorize;
# a file holding one in `env` is refused if others may read it).
SECRET_NAME = re.compile(r"TOKEN|SECRET|KEY|PASSWORD|CREDENTIAL", re.IGNORECASE)


class GatewayConfigError(ValueError):
    """A gateway file that cannot be used: the message names the file, the table and the key, and
    says what to fix."""


@dataclass(frozen=True)
class ToolOverride:
    effect: str | None = None
    risk: str | None = None


def _empty() -> Mapping[Any, Any]:
    return MappingProxyType({})


@dataclass(frozen=True)
class UpstreamConfig:
    name: str
    command: tuple[str, ...] = ()                # exactly one of command / url
    url: str = ""
    sandbox: str = "workspace-write"
    workspace: str = ""                          # "" -> the private default directory (resolved by load())
    writable_roots: tuple[str, ...] = ()
    network: bool = False
    allow_domains: tuple[str, ...] = ()
    credentials: tuple[str, ...] = ()            # "VAR=https://HOST[;how]", as the --credential flag
    env: Mapping[str, str] = field(default_factory=_empty)
    pass_env: tuple[str, ...] = ()
    trusted: bool = False
    tools: Mapping[str, ToolOverride] = field(default_factory=_empty)
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS   # per upstream call
    start: str = "gateway"                       # "gateway" (when the gateway starts) or "first_use"


@dataclass(frozen=True)
class GatewayConfig:
    path: str
    upstreams: tuple[UpstreamConfig, ...]


def default_workspace(name: str, environ: Mapping[str, str] | None = None) -> str:
    """An upstream's private directory: ``$XDG_STATE_HOME/sandboxd/gateway/NAME``, else
    ``~/.local/state/sandboxd/gateway/NAME`` (created 0700 when its session is opened)."""
    environ = os.environ if environ is None else environ
    state = environ.get("XDG_STATE_HOME", "")
    if not os.path.isabs(state):                 # the XDG spec: a relative value is ignored
        state = os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "sandboxd", "gateway", name)


def _home() -> str:
    """The user's home as the daemon finds it (the user database), "" if none."""
    import pwd
    try:
        home = pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:
        return ""
    return os.path.normpath(home) if home else ""


class _Table:
    """One table of the file, for messages: ``FILE: [upstreams.NAME] KEY: what; fix``."""

    def __init__(self, path: str, title: str) -> None:
        self.path, self.title = path, title

    def error(self, key: str, what: str) -> GatewayConfigError:
        where = f"{printable(self.path)}: [{printable(self.title)}]"
        return GatewayConfigError(f"{where} {printable(key)}: {what}" if key else f"{where}: {what}")


def _type_name(value: object) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a table"}.get(type(value), type(value).__name__)


def _text(table: _Table, key: str, value: object, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise table.error(key, f"is {_type_name(value)}: give a string")
    if "\x00" in value:
        raise table.error(key, "holds a NUL character: remove it")
    if not value and not allow_empty:
        raise table.error(key, "is empty: give a value or leave the key out")
    if len(value) > MAX_TEXT:
        raise table.error(key, f"is {len(value)} characters long: at most {MAX_TEXT}")
    return value


def _texts(table: _Table, key: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise table.error(key, f"is {_type_name(value)}: give a list of strings, like [\"a\", \"b\"]")
    if len(value) > MAX_LIST:
        raise table.error(key, f"has {len(value)} entries: at most {MAX_LIST}")
    return tuple(_text(table, f"{key}[{index}]", item) for index, item in enumerate(value))


def _bool(table: _Table, key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise table.error(key, f"is {_type_name(value)}: give true or false")
    return value


def _choice(table: _Table, key: str, value: object, choices: tuple[str, ...]) -> str:
    text = _text(table, key, value)
    if text not in choices:
        raise table.error(key, f"is {printable(text)!r}: give one of {', '.join(repr(c) for c in choices)}")
    return text


def _absolute(table: _Table, key: str, value: object) -> str:
    path = os.path.expanduser(_text(table, key, value))
    if not os.path.isabs(path):
        raise table.error(key, f"{printable(path)!r} is relative: give an absolute path (or one that starts with ~/)")
    return os.path.normpath(path)


def _variable(table: _Table, key: str, name: str) -> str:
    """An environment variable's name as the daemon takes it: no '=' or NUL, not empty."""
    if not name or "=" in name or "\x00" in name:
        raise table.error(key, f"the variable name {printable(name)!r} is not usable: give a name without '=' or NUL")
    if len(name.encode(errors="surrogateescape")) > MAX_ENV_NAME:
        raise table.error(key, f"the variable name {printable(name[:100])!r}... is over {MAX_ENV_NAME} bytes, the "
                               "daemon's bound: give a shorter name")
    return name


def _env(table: _Table, value: object) -> Mapping[str, str]:
    if not isinstance(value, dict):
        raise table.error("env", f"is {_type_name(value)}: give a table of NAME = \"value\"")
    if len(value) > MAX_LIST:
        raise table.error("env", f"has {len(value)} variables: at most {MAX_LIST}")
    env = {}
    for name, text in value.items():
        env[_variable(table, "env", name)] = _text(table, f"env.{name}", text, allow_empty=True)
    return MappingProxyType(env)


def _credentials(table: _Table, value: object) -> tuple[str, ...]:
    specs, names = [], []
    for index, text in enumerate(_texts(table, "credentials", value)):
        try:
            spec = parse_credential(text)        # the --credential flag's own parser
        except InvalidPolicy as exc:
            raise table.error(f"credentials[{index}]", str(exc)) from None
        if spec.name in names:
            raise table.error(f"credentials[{index}]", f"{spec.name} is named twice: name each variable once")
        names.append(spec.name)
        specs.append(spec.text())
    return tuple(specs)


def _url(table: _Table, value: object) -> str:
    text = _text(table, "url", value)
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise table.error("url", f"{printable(text)!r} is not an http(s) URL: give https://HOST/PATH")
    if parts.username or parts.password:
        raise table.error("url", "holds a user or password: give the secret as a credential instead "
                                 "(credentials = [\"VAR=https://HOST\"])")
    return text


def _tools(path: str, upstream: str, value: object) -> Mapping[str, ToolOverride]:
    table = _Table(path, f"upstreams.{upstream}")
    if not isinstance(value, dict):
        raise table.error("tools", f"is {_type_name(value)}: give [upstreams.{upstream}.tools.TOOL] tables")
    if len(value) > MAX_TOOL_OVERRIDES:
        raise table.error("tools", f"overrides {len(value)} tools: at most {MAX_TOOL_OVERRIDES}")
    overrides = {}
    for tool, fields in value.items():
        inner = _Table(path, f"upstreams.{upstream}.tools.{tool}")
        if not tool or len(tool) > MAX_TEXT or "\x00" in tool:
            raise inner.error("", "the tool name is empty, too long or holds a NUL: give the upstream's tool name")
        if not isinstance(fields, dict):
            raise inner.error("", f"is {_type_name(fields)}: give a table with effect and/or risk")
        unknown = sorted(set(fields) - {"effect", "risk"})
        if unknown:
            raise inner.error(unknown[0], "is not a key of a tool override: use effect or risk")
        effect = _choice(inner, "effect", fields["effect"], Effect.ALL) if "effect" in fields else None
        risk = _choice(inner, "risk", fields["risk"], RISKS) if "risk" in fields else None
        overrides[tool] = ToolOverride(effect=effect, risk=risk)
    return MappingProxyType(overrides)


_KEYS = ("command", "url", "sandbox", "workspace", "writable_roots", "network", "allow_domains", "credentials", "env",
         "pass_env", "trusted", "tools", "timeout_seconds", "start")


def _check_fit(table: _Table, fields: dict[str, Any]) -> None:
    """The keys of one upstream that the daemon would refuse together only when it starts (or that
    would hand its secret or the user's home back to it): refused now, at load."""
    phantoms = {spec.partition("=")[0] for spec in fields.get("credentials", ())}
    for key in ("env", "pass_env"):
        clash = sorted(phantoms & set(fields.get(key, ())))
        if clash:
            raise table.error(key, f"{printable(clash[0])} is a credential's variable (it holds the phantom the "
                                   "proxy swaps for the secret): leave it out")
    if fields.get("sandbox") == "read-only":
        for key in ("url", "network", "allow_domains", "credentials", "writable_roots"):
            if fields.get(key):
                raise table.error(key, "a read-only sandbox has no network and no writable roots: use "
                                       "sandbox = \"workspace-write\" (or leave the key out)")
    if fields.get("sandbox") != "danger-full-access":
        # Every upstream session but danger-full-access hides the user's home (its keys); a workspace
        # or writable root that holds the home would show it again, and the daemon refuses it.
        home = _home()
        for key, directory in [("workspace", fields["workspace"]), *(
                (f"writable_roots[{index}]", root) for index, root in enumerate(fields.get("writable_roots", ())))]:
            if home and (directory == "/" or home == directory or home.startswith(directory.rstrip("/") + "/")):
                raise table.error(key, f"{printable(directory)} holds your home {printable(home)}, which an upstream's "
                                       "session hides (its keys, its configuration): give a directory inside it "
                                       "(~/project) or elsewhere")
    if fields.get("sandbox") == "danger-full-access":
        for key in ("allow_domains", "credentials"):
            if fields.get(key):
                raise table.error(key, "is an option of sandbox = \"workspace-write\" (danger-full-access is the "
                                       "host's network as it is, with no proxy to hold a list or a secret)")


def _check_environment(table: _Table, fields: dict[str, Any], environ: Mapping[str, str]) -> None:
    """The server's variables as the daemon will take them (policy.limits: each value, all of them
    together, the command with them within ARG_MAX), with the pass_env values set now: a file the
    daemon would refuse at every start is an error here, not a restart loop."""
    variables = [("env", name, text) for name, text in fields.get("env", {}).items()]
    variables += [("pass_env", name, environ[name]) for name in fields.get("pass_env", ()) if name in environ]
    total = 0
    for key, name, text in variables:
        size = len(text.encode(errors="surrogateescape"))
        if size > MAX_ENV_VALUE:
            raise table.error(key, f"{printable(name)} is {size} bytes: the daemon takes at most {MAX_ENV_VALUE} per "
                                   "variable (pass large data in a file)")
        if "\x00" in text:
            raise table.error(key, f"{printable(name)} holds a NUL character, which no program can be given")
        total += len(name.encode(errors="surrogateescape")) + size + 2
    if total > MAX_ENV_TOTAL_BYTES:
        raise table.error("env", f"the server's variables (env, and the pass_env ones set now) take {total} bytes "
                                 f"as NAME=value: at most {MAX_ENV_TOTAL_BYTES}; pass large data in a file")
    if fields.get("command"):
        try:
            check_command(fields["command"], {name: text for _key, name, text in variables})
        except InvalidPolicy as exc:
            raise table.error("command", f"{printable(str(exc))}") from None


def _upstream(path: str, name: str, value: object, environ: Mapping[str, str]) -> UpstreamConfig:
    table = _Table(path, f"upstreams.{name}")
    if not UPSTREAM_NAME.fullmatch(name):
        raise table.error("", "the upstream's name must be 1 to 24 of a-z, 0-9 and '-' (not first '-'; no '_', "
                              "which the gateway's tool names use as the separator): rename the table")
    if not isinstance(value, dict):
        raise table.error("", f"is {_type_name(value)}: give a table")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise table.error(unknown[0], f"is not a key of an upstream (a typo?): use {', '.join(_KEYS)}")
    if ("command" in value) == ("url" in value):
        raise table.error("", "give exactly one of command = [\"program\", \"arg\", ...] (a stdio server) or url")
    fields: dict[str, Any] = {"name": name}
    if "command" in value:
        fields["command"] = _texts(table, "command", value["command"])
        if not fields["command"]:
            raise table.error("command", "is empty: give the program and its arguments")
    if "url" in value:
        fields["url"] = _url(table, value["url"])
    if "sandbox" in value:
        fields["sandbox"] = _choice(table, "sandbox", value["sandbox"], SANDBOXES)
    fields["workspace"] = (_absolute(table, "workspace", value["workspace"]) if "workspace" in value
                           else default_workspace(name, environ))
    if "writable_roots" in value:
        fields["writable_roots"] = tuple(_absolute(table, f"writable_roots[{index}]", item)
                                         for index, item in enumerate(_texts(table, "writable_roots",
                                                                             value["writable_roots"])))
    for key in ("network", "trusted"):
        if key in value:
            fields[key] = _bool(table, key, value[key])
    if "allow_domains" in value:
        fields["allow_domains"] = _texts(table, "allow_domains", value["allow_domains"])
    if "credentials" in value:
        fields["credentials"] = _credentials(table, value["credentials"])
    if "env" in value:
        fields["env"] = _env(table, value["env"])
    if "pass_env" in value:
        fields["pass_env"] = tuple(_variable(table, "pass_env", item)
                                   for item in _texts(table, "pass_env", value["pass_env"]))
    _check_fit(table, fields)
    _check_environment(table, fields, environ)
    if "tools" in value:
        fields["tools"] = _tools(path, name, value["tools"])
    if "timeout_seconds" in value:
        timeout = value["timeout_seconds"]
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise table.error("timeout_seconds", f"is {_type_name(timeout)}: give seconds as a number")
        if not 0 < timeout <= MAX_TIMEOUT_SECONDS:
            raise table.error("timeout_seconds", f"is {timeout}: give seconds above 0, at most {MAX_TIMEOUT_SECONDS:g}")
        fields["timeout_seconds"] = float(timeout)
    if "start" in value:
        fields["start"] = _choice(table, "start", value["start"], STARTS)
    return UpstreamConfig(**fields)


def parse(path: str, text: str, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """The gateway file's text (read from ``path``, named in messages) as a GatewayConfig."""
    environ = os.environ if environ is None else environ
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise GatewayConfigError(f"{printable(path)}: not valid TOML: {printable(str(exc))}") from None
    unknown = sorted(set(document) - {"upstreams"})
    if unknown:
        raise GatewayConfigError(f"{printable(path)}: {printable(unknown[0])}: not a key of a gateway file: give "
                                 "[upstreams.NAME] tables only")
    upstreams = document.get("upstreams")
    if not isinstance(upstreams, dict) or not upstreams:
        raise GatewayConfigError(f"{printable(path)}: no upstream: give at least one [upstreams.NAME] table with "
                                 "command = [...]")
    if len(upstreams) > MAX_UPSTREAMS:
        raise GatewayConfigError(f"{printable(path)}: {len(upstreams)} upstreams: at most {MAX_UPSTREAMS}")
    config = GatewayConfig(path=path, upstreams=tuple(_upstream(path, name, value, environ)
                                                      for name, value in upstreams.items()))
    # A credential's variable is a secret of the gateway's environment: no upstream may be handed
    # it in the clear, also not another upstream than the one that names it.
    # One variable backs one upstream: the person set GITHUB_TOKEN for [upstreams.github], and a
    # second upstream naming it (for its own host, or even the same one) would be handed that secret.
    secrets: dict[str, str] = {}
    for upstream in config.upstreams:
        for spec in upstream.credentials:
            variable = spec.partition("=")[0]
            if variable in secrets:
                raise _Table(path, f"upstreams.{upstream.name}").error(
                    "credentials", f"{printable(variable)} is [upstreams.{secrets[variable]}]'s credential: a "
                                   f"variable backs one upstream only; give {upstream.name} a variable of its own")
            secrets[variable] = upstream.name
    for upstream in config.upstreams:
        for key, names in (("env", upstream.env), ("pass_env", upstream.pass_env)):
            for variable in names:
                if variable in secrets:
                    raise _Table(path, f"upstreams.{upstream.name}").error(
                        key, f"{printable(variable)} is a credential's variable of [upstreams.{secrets[variable]}] (a "
                             "secret of the gateway's environment): leave it out")
    return config


def load(path: str) -> GatewayConfig:
    """The gateway file at ``path``, or GatewayConfigError saying what to fix.

    The file decides every upstream's walls, so it is taken only as ssh takes its configuration: a
    regular file (a FIFO would hang the start) owned by the user or root that nobody else may
    write (another user's file, a shared /tmp file, could hand an upstream danger-full-access)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise GatewayConfigError(f"{printable(path)}: cannot read the gateway file ({exc.strerror})") from None
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise GatewayConfigError(f"{printable(path)}: not a regular file: give the gateway file itself")
        if info.st_uid not in (os.getuid(), 0):
            raise GatewayConfigError(f"{printable(path)}: owned by uid {info.st_uid}, not by you or root: a gateway "
                                     "file decides the upstreams' walls; use a file of your own")
        if info.st_mode & 0o022:
            raise GatewayConfigError(f"{printable(path)}: others may write it (mode {stat.S_IMODE(info.st_mode):o}): "
                                     f"chmod go-w {printable(path)}")
        readable_by_others = bool(info.st_mode & 0o044)
        with os.fdopen(descriptor, "rb", closefd=False) as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise GatewayConfigError(f"{printable(path)}: cannot read the gateway file ({exc.strerror})") from None
    finally:
        os.close(descriptor)
    if len(data) > MAX_FILE_BYTES:
        raise GatewayConfigError(f"{printable(path)}: the gateway file is over {MAX_FILE_BYTES >> 20} MiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise GatewayConfigError(f"{printable(path)}: not UTF-8 text (TOML is UTF-8)") from None
    config = parse(os.path.abspath(path), text)
    if readable_by_others:
        # As ssh refuses a key others may read: a literal secret in `env` is the user's alone.
        for upstream in config.upstreams:
            secret = sorted(name for name in upstream.env if SECRET_NAME.search(name))
            if secret:
                raise GatewayConfigError(
                    f"{printable(path)}: others may read it (mode {stat.S_IMODE(info.st_mode):o}) and "
                    f"[upstreams.{upstream.name}] env holds {printable(secret[0])}, a secret by its name: "
                    f"chmod 600 {printable(path)}, or pass it with pass_env or credentials instead")
    return config
