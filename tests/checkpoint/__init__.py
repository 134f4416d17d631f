"""Tests of hftrain/checkpoint/ (tests mirror the package)."""
