"""Tests of hftrain/training/ (tests mirror the package)."""
