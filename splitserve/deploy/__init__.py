"""Kubernetes manifests from a resolved serve plan (``dynamo deploy render``)."""
