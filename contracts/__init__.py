"""The contracts floor: everything that crosses a component or process boundary.

Wire messages and their vocabularies, the ``Engine`` protocol with its declared
capabilities, the prefill job and its handoff, KV events, the sections every
component's config is built from and the shared config-validation helpers, and
(under ``kit``) the hosting kit a component process stands on: the runtime
wrapper, etcd and NATS access, process and port helpers.

Nothing here imports any other part of the project; every component and the
application stand on it.  ``pyproject.toml``'s import-linter contracts enforce it.
"""
