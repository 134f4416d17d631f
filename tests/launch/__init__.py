"""Tests of hftrain/launch/ (tests mirror the package)."""
