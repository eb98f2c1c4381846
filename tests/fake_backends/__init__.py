"""Backends written as a newcomer would write them: each one module behind its seam, registered by one entry
(tests/test_plugins.py adds them to the registries and runs them)."""
