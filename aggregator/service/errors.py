"""The two ways a service stops short: with one clear line (:class:`ServiceError`), or because it
was asked to while it waited (:class:`Stopping`)."""

__all__ = ["ServiceError", "Stopping"]


class ServiceError(RuntimeError):
    """A condition that stops the service with a clear message."""


class Stopping(Exception):
    """The service was asked to stop while it waited (nothing more is made durable)."""
