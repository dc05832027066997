"""Tests of worker/checkpoint/."""
