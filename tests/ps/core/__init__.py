"""Tests of ps/core/."""
