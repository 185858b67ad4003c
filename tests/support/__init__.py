"""Helpers, factories and stand-ins shared by the tests (never a test module itself)."""
