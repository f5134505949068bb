"""The error every configuration problem raises."""


class ConfigError(ValueError):
    """A configuration problem, with what to change."""
