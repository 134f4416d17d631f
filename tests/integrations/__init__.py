"""Tests of hftrain/integrations/ (tests mirror the package)."""
