"""User-facing errors.

Anything the user can fix (a bad config, a missing file, an impossible batch split) raises
`UserError` with a message that says what is wrong and how to fix it. The CLI prints it as one line
on stderr and exits with code 2; nothing else is printed. `assert` is kept for internal invariants.
"""

import argparse
import sys


class UserError(Exception):
    """An error in the user's input; the message says what is wrong and how to fix it."""


class ConfigError(UserError):
    """An invalid configuration file or override."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, corrupted or incompatible."""


class PeerFailure(Exception):
    """Another rank died or hung; the message names it. Not the user's input: exit code 1."""


class OneLineParser(argparse.ArgumentParser):
    """argparse whose bad-argument error is one line on stderr and exit 2, without the usage block
    argparse would print too; `error_line` says what the line reads."""

    def error(self, message: str):
        print(self.error_line(message), file=sys.stderr)
        sys.exit(2)

    def error_line(self, message: str) -> str:
        return f"{self.prog}: error: {message}"
