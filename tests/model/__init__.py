"""Tests of hftrain/model/ (tests mirror the package)."""
