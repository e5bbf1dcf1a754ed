"""Tests that run in one process (the test's own): no rank, no CLI process, no install."""
