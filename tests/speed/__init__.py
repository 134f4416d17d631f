"""Tests of hftrain/speed/ (tests mirror the package)."""
