"""Tests of worker/sync/."""
