"""ConfigError: the one exception for a config that cannot work, with teaching messages."""

from __future__ import annotations


class ConfigError(ValueError):
    """A spec or plan that cannot work.

    ``problems`` holds one message per problem; each names the field, the value
    and the fix. ``str(err)`` joins them on one line for the CLI.
    """

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


def check_choice(problems: list[str], field: str, value: object, choices: tuple) -> None:
    """Append a message when ``value`` is not one of ``choices``."""
    if value not in choices:
        problems.append(f"{field}={value!r} is not one of {'|'.join(map(str, choices))}")


def check_positive(problems: list[str], field: str, value: object) -> None:
    """Append a message when ``value`` is not a positive number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        problems.append(f"{field}={value!r} must be a positive number")


def raise_if(problems: list[str]) -> None:
    """Raise one ConfigError carrying every problem found, if any."""
    if problems:
        raise ConfigError(problems)
