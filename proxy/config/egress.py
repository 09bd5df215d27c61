"""Which egress (forward) proxy, if any, each upstream is reached through.

Settings, most specific first:
- `[[upstream]] egress_proxy`: a proxy URL, "none" (or "direct") for a direct connection,
  "" (the default) for the server's setting;
- `[server] egress_proxy`: the same, where "" means the environment;
- the environment, read as curl and httpx read it: `https_proxy`/`HTTPS_PROXY` for https://
  upstreams, `http_proxy`/`HTTP_PROXY` for http:// ones, `all_proxy`/`ALL_PROXY` for both
  (lower case wins), and `no_proxy`/`NO_PROXY` (host names, domain suffixes, IP addresses,
  CIDR ranges, optional `:port`, `*` for everything) to go direct. NO_PROXY applies only to
  proxies from the environment: a proxy set in the config is used as set.

Only http:// proxy URLs are supported (absolute-form requests for http:// upstreams, CONNECT
tunnels for https:// ones); `user:password@` in one becomes Proxy-Authorization and is
never shown or logged. Resolved once at startup from the config, so a bad URL is a config
error then, not a failure per request. Pure and I/O-free.
"""

from __future__ import annotations

import base64
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from proxy.config.schema import Config, UpstreamConfig

DIRECT = ("none", "direct")
Origin = tuple[str, str, int]


@dataclass(frozen=True)
class ProxyURL:
    host: str
    port: int
    # Credentials: excluded from repr, so that no log or traceback line can show them.
    url: str = field(repr=False)  # with its userinfo: for httpx.Proxy
    authorization: bytes | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def shown(self) -> str:
        return f"http://{self.address}"


def parse_proxy_url(raw: str) -> ProxyURL:
    """A proxy URL, or ValueError saying what is wrong with it (without its credentials)."""
    text = raw.strip()
    if "://" not in text:
        text = "http://" + text  # curl reads "host:port" as an http:// proxy
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme != "http":
        raise ValueError(f"only http:// egress proxies are supported, not {scheme}://")
    try:
        port = parts.port or 80
    except ValueError:
        raise ValueError("the proxy URL's port is not a number from 0 to 65535") from None
    if not parts.hostname:
        raise ValueError("the proxy URL has no host name")
    authorization = None
    if parts.username is not None:
        pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        authorization = b"Basic " + base64.b64encode(pair.encode())
    return ProxyURL(parts.hostname, port, text, authorization)


@dataclass(frozen=True)
class Choice:
    """One upstream's egress: its proxy (None: direct) and where that was decided."""

    proxy: ProxyURL | None
    source: str


def _env(environ: Mapping[str, str], name: str) -> str:
    return (environ.get(name.lower()) or environ.get(name.upper()) or "").strip()


def no_proxy_matches(rules: str, host: str, port: int) -> bool:
    host = host.lower().strip("[]")
    for rule in (r.strip().lower() for r in rules.split(",")):
        if not rule:
            continue
        if rule == "*":
            return True
        name, rule_port = rule, None
        if rule.count(":") == 1 or rule.startswith("["):  # host:port, [v6]:port
            name, _, tail = rule.rpartition(":")
            rule_port = int(tail) if tail.isdigit() else None
            if rule_port is None:
                name = rule
        name = name.strip("[]").lstrip("*")  # "*.example.com" as ".example.com"
        if rule_port is not None and rule_port != port:
            continue
        if (
            _ip_match(name, host)
            or host == name.lstrip(".")
            or host.endswith("." + name.lstrip("."))
        ):
            return True
    return False


def _ip_match(rule: str, host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
        return address in ipaddress.ip_network(rule, strict=False)
    except ValueError:
        return False


def _from_environment(environ: Mapping[str, str], origin: Origin) -> Choice:
    scheme, host, port = origin
    for name in (f"{scheme}_proxy", "all_proxy"):
        value = _env(environ, name)
        if not value:
            continue
        label = name.upper()
        if no_proxy_matches(_env(environ, "no_proxy"), host, port):
            return Choice(None, f"NO_PROXY (beside {label})")
        try:
            return Choice(parse_proxy_url(value), label)
        except ValueError as exc:
            raise ValueError(f"{label}: {exc}") from None
    return Choice(None, "")


def origin(url: str) -> Origin:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:  # config.check reports the URL itself
        port = None
    return scheme, (parts.hostname or "").lower(), port or (443 if scheme == "https" else 80)


def choose(
    up: UpstreamConfig, server_setting: str, environ: Mapping[str, str], where: str
) -> Choice:
    for setting, label in ((up.egress_proxy, f"{where}.egress_proxy"), (server_setting, "")):
        setting = setting.strip()
        if not setting:
            continue
        label = label or "server.egress_proxy"
        if setting.lower() in DIRECT:
            return Choice(None, label)
        try:
            return Choice(parse_proxy_url(setting), label)
        except ValueError as exc:
            raise ValueError(f"{label}: {exc}") from None
    return _from_environment(environ, origin(up.url))


class EgressPlan:
    """The proxy for each upstream origin; the transports ask it per connection."""

    def __init__(self, choices: Mapping[Origin, Choice] | None = None) -> None:
        self.choices = dict(choices or {})

    def proxy_for(self, scheme: str, host: str, port: int) -> ProxyURL | None:
        choice = self.choices.get((scheme, host.lower(), port))
        return None if choice is None else choice.proxy

    def proxies(self) -> set[ProxyURL]:
        return {c.proxy for c in self.choices.values() if c.proxy is not None}


def plan(config: Config, environ: Mapping[str, str]) -> EgressPlan:
    """Every upstream's egress; ValueError naming the setting when one is malformed."""
    choices: dict[Origin, Choice] = {}
    for i, up in enumerate(config.upstream):
        choice = choose(up, config.server.egress_proxy, environ, f"upstream[{i}]")
        # Connections are pooled per origin: the first upstream's choice decides for an
        # origin shared by several (config.check refuses conflicting ones).
        choices.setdefault(origin(up.url), choice)
    return EgressPlan(choices)


def problems(config: Config) -> list[str]:
    """The egress settings' problems, for config.check: each with its key path."""
    found: list[str] = []
    settings = [("server.egress_proxy", config.server.egress_proxy)]
    settings += [
        (f"upstream[{i}].egress_proxy", u.egress_proxy) for i, u in enumerate(config.upstream)
    ]
    for where, setting in settings:
        if setting.strip() and setting.strip().lower() not in DIRECT:
            try:
                parse_proxy_url(setting)
            except ValueError as exc:
                found.append(f"{where}: {exc}")  # the message never repeats the URL
    # Connections are pooled per origin, so one origin has one egress.
    chosen: dict[Origin, str] = {}
    for i, up in enumerate(config.upstream):
        setting = (up.egress_proxy or config.server.egress_proxy).strip()
        key = origin(up.url)
        if chosen.setdefault(key, setting) != setting:
            found.append(
                f"upstream[{i}].egress_proxy: another upstream at the same scheme, host and "
                "port uses a different egress proxy"
            )
    return found


def startup_lines(config: Config, environ: Mapping[str, str]) -> list[str]:
    """One line per upstream that goes through an egress proxy (credentials never shown)."""
    lines = []
    for i, up in enumerate(config.upstream):
        choice = choose(up, config.server.egress_proxy, environ, f"upstream[{i}]")
        if choice.proxy is not None:
            lines.append(
                f"  egress proxy for {up.name!r}: {choice.proxy.shown} (from {choice.source})"
            )
    return lines
