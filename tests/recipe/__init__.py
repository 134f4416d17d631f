"""Tests of hftrain/recipe/ (tests mirror the package)."""
