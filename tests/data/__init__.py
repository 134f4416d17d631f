"""Tests of hftrain/data/ (tests mirror the package)."""
