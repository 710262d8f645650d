"""Unit tests of the KV-aware router core."""
