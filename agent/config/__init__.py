"""Settings: one declaration per setting serves flags, ``TESSERA_*`` variables and the docs.

A settings class is a frozen dataclass whose fields are declared with :func:`setting`: flag(s),
help, default (or :data:`REQUIRED`), and how one raw string becomes a value (from the field's type,
``choices`` or ``parse``). The daemon's :class:`Config` is made of groups of them
(``config.http``, ``config.telemetry``, ...; :mod:`agent.config.agent_config`); the options of
single commands (``-o/--output``, ``--socket``, ...) are others, declared next to their commands
in ``agent/cli/``. The package:

- :mod:`~agent.config.declare`: :func:`setting`, and :func:`settings_of` resolving declarations;
- :mod:`~agent.config.converters`: the value converters (one raw string -> value);
- :mod:`~agent.config.options`: :func:`add_options` (argparse) and :func:`load_settings` (flags
  and environment -> settings, a bad value a ConfigError naming its flag or variable);
- :mod:`~agent.config.node_settings`, :mod:`~agent.config.daemon_settings`,
  :mod:`~agent.config.serving_settings`: the groups of Config; ``agent.cli.docs`` renders
  docs/configuration.md from them;
- :mod:`~agent.config.budgets_settings`: the budget controller's (``tessera budgets``).

Nothing below the CLI reads ``os.environ``: the CLI passes the environment in.
"""

from agent.config.agent_config import Config, load_config, settings
from agent.config.budgets_settings import BudgetsSettings
from agent.config.converters import (
    CrashAt,
    boolean,
    crash_at,
    dns_subdomain,
    fraction,
    host_port,
    integer,
    memory_quantity,
    non_negative_int,
    non_negative_seconds,
    number,
    parse_host_port,
    path,
    pod_uid_text,
    port,
    positive_int,
    seconds,
    text,
)
from agent.config.daemon_settings import (
    CdiSettings,
    ClusterSettings,
    DaemonSettings,
    KubeletSettings,
    PublishingSettings,
    SharingSettings,
)
from agent.config.declare import (
    ENV_PREFIX,
    REQUIRED,
    Origin,
    Setting,
    SettingMeta,
    build_settings,
    env_name,
    flag_name,
    sections_of,
    setting,
    settings_of,
)
from agent.config.node_settings import DriverSettings, NodeSettings, SimulatorSettings
from agent.config.options import add_options, dest, load_settings, option_help, resolve_settings
from agent.config.serving_settings import HttpSettings, TelemetrySettings

__all__ = [
    "ENV_PREFIX", "REQUIRED", "BudgetsSettings", "CdiSettings", "ClusterSettings", "Config",
    "CrashAt", "DaemonSettings", "DriverSettings", "HttpSettings", "KubeletSettings",
    "NodeSettings", "Origin", "PublishingSettings", "Setting", "SettingMeta", "SharingSettings",
    "SimulatorSettings", "TelemetrySettings", "add_options", "boolean", "build_settings",
    "crash_at", "dest", "dns_subdomain", "env_name", "flag_name", "fraction", "host_port",
    "integer", "load_config", "load_settings", "memory_quantity", "non_negative_int",
    "non_negative_seconds", "number", "option_help", "parse_host_port", "path", "pod_uid_text",
    "port", "positive_int", "resolve_settings", "seconds", "sections_of", "setting", "settings",
    "settings_of", "text",
]  # fmt: skip
