"""Errors a user can meet while recording. Each message is one line and says what to do next."""

from store.errors import StoreError, UserError


class NotPrivileged(UserError):
    pass


class ProbeError(UserError):
    pass


class TargetError(UserError):
    pass


__all__ = ["NotPrivileged", "ProbeError", "StoreError", "TargetError", "UserError"]
