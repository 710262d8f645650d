"""Unit tests of the prefill queue's pure parts."""
