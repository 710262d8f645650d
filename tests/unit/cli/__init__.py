"""Tests of the `dynamo` CLI commands."""
