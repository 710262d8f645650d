"""Unit tests of the disaggregated router (remote or local prefill)."""
