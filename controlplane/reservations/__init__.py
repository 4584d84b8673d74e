"""Reservations: admission, lifecycle, reads."""
