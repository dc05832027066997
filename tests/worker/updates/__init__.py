"""Tests of worker/updates/."""
