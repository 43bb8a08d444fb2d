"""SIGHUP's reload: the tenants of the config file (and of its tenants_file) taken up without a restart.

Only the tenants are reloaded: their keys, priorities and quotas are checks the frontend makes per request, and it
can swap them between two requests. Every other key shapes something already running (a listener, a scheduler's
engine, admission's queue bounds, the models loaded), so a changed one is named in `needs_restart` and left as it
is. The file is read and checked whole, exactly as at startup: any error refuses all of it, and the running
config stays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from daemon.config import ADMISSION_OPTIONS, DAEMON_OPTIONS, ENGINE_OPTIONS, ServeConfig
from frontend.spec import TenantSpec

# tenants_file is where tenants come from: a reload reads the file it names now, so a new path is taken up too.
_RELOADED_KEYS = frozenset({"tenants", "tenants_file"})


@dataclass(frozen=True)
class TenantReload:
    config: ServeConfig  # the running config with the new tenants (and tenants_file), nothing else changed
    changes: list[str]  # what the reload changed, in words ("tenant 'bob' added"); never a key or its hash
    needs_restart: list[str]  # keys whose new value differs from the running one and waits for a restart


def reload_tenants(current: ServeConfig, reload_config: Callable[[], ServeConfig]) -> TenantReload:
    """The running config with the tenants of a fresh read (`reload_config`: load_serve_config on the daemon's own
    arguments), what changed, and what waits for a restart. ValueError naming the key for a file that fails any
    check, or that would turn authentication off: then nothing of it applies."""
    try:
        new = reload_config()
    except TypeError as error:  # a value of a type no check foresaw
        raise ValueError(f"config: {error}") from None
    if current.tenants and not new.tenants:
        # A missing [[tenants]] table (a tenants_file emptied by a deploy gone wrong) must not open the daemon to
        # anyone who can reach it; serving without keys is a choice made at startup.
        raise ValueError(
            "tenants: the reloaded config has no tenants, which would turn authentication off; "
            "restart the daemon to serve without API keys"
        )
    config = msgspec.structs.replace(current, tenants=new.tenants, tenants_file=new.tenants_file)
    changes = tenant_changes(current.tenants, new.tenants)
    if new.tenants_file != current.tenants_file:
        changes.insert(0, f"tenants_file {_shown(current.tenants_file)} -> {_shown(new.tenants_file)}")
    return TenantReload(config, changes, _restart_keys(current, new))


def tenant_changes(old: Sequence[TenantSpec], new: Sequence[TenantSpec]) -> list[str]:
    """Each tenant added, removed or changed (field by field, a key only as "api key changed"), in file order."""
    before = {tenant.name: tenant for tenant in old}
    after = {tenant.name: tenant for tenant in new}
    changes = []
    for name, tenant in before.items():
        if name not in after:
            changes.append(f"tenant {name!r} removed")
            continue
        for field in msgspec.structs.fields(TenantSpec):
            was, now = getattr(tenant, field.name), getattr(after[name], field.name)
            if was == now:
                continue
            if field.name == "api_key_sha256":
                changes.append(f"tenant {name!r}: api key changed")
            else:
                changes.append(f"tenant {name!r}: {field.name} {_shown(was)} -> {_shown(now)}")
    changes += [f"tenant {name!r} added" for name in after if name not in before]
    return changes


def _restart_keys(old: ServeConfig, new: ServeConfig) -> list[str]:
    """The config keys (as the file spells them) whose values differ and that a reload does not apply."""
    parts: list[tuple[list, Callable[[ServeConfig], object]]] = [
        (DAEMON_OPTIONS, lambda config: config),
        (ENGINE_OPTIONS, lambda config: config.engine),
        (ADMISSION_OPTIONS, lambda config: config.admission),
    ]
    keys = [
        option.key
        for options, part in parts
        for option in options
        if option.key not in _RELOADED_KEYS and getattr(part(old), option.key) != getattr(part(new), option.key)
    ]
    if old.models != new.models:
        keys.append("models")
    return keys


def _shown(value: object) -> str:
    """A value as the TOML file writes it, near enough: "batch", 600, true, ["m"]."""
    return msgspec.json.encode(value).decode()
