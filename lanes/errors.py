"""The one error type the CLI turns into a single line and a non-zero exit."""


class UserError(Exception):
    """Something the user can fix: printed as one line, exit status 2."""
