"""Tests of hftrain/cli/ (tests mirror the package)."""
