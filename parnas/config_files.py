"""A config's YAML, read from a file or a preset shipped in ``parnas/presets`` (``--config tiny``), within the
limits :mod:`parnas.reading` keeps; every mistake one line naming the file."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from parnas import reading
from parnas.arguments import presets
from parnas.errors import ConfigError


def is_preset(source: str | Path) -> bool:
    """Whether ``source`` names a preset shipped with parnas rather than a file (a file of that name wins)."""
    path = Path(source)
    return not path.suffix and not path.exists()


def read_yaml(source: str | Path) -> dict[str, Any]:
    """Read a config file, or a preset by name (``tiny``, ``wt2-seed``)."""
    path = Path(source)
    if is_preset(source):
        preset = resources.files("parnas") / "presets" / f"{source}.yaml"
        if not preset.is_file():
            raise ConfigError(f"no config file or preset named {str(source)!r}; presets: {', '.join(presets())}")
        text = preset.read_text()
    else:
        try:
            text = reading.read_text(path)
        except OSError as e:
            raise ConfigError(f"cannot read config {source}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{source} is not a YAML config (not UTF-8 text)") from None
    try:
        values = reading.parse_yaml(text, str(source))
    except yaml.YAMLError as e:
        raise ConfigError(f"{source} is not valid YAML: {str(e).splitlines()[0]}") from None
    if values is None:  # nothing but blanks and comments: almost surely not the file meant
        raise ConfigError(f"{source}: empty config; omit --config for the defaults")
    if not isinstance(values, dict):
        raise ConfigError(f"{source} must hold a mapping of sections (model, data, train)")
    return values
