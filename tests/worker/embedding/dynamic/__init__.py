"""Tests of worker/embedding/dynamic/."""
