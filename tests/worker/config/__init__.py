"""Tests of worker/config/."""
