"""Tests of hftrain/export/ (tests mirror the package)."""
