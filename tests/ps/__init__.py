"""Tests of ps/."""
