"""Unit tests of the QoS core (classes, estimator, admission, degradation)."""
