"""Errors a user can meet. Each message is one line and says what to do next."""


class UserError(Exception):
    """A problem the user can fix; the CLI prints the message alone and exits with status 2."""


class StoreError(UserError):
    """The database cannot be used as asked (missing, foreign, corrupt, newer, unwritable)."""
