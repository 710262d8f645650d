"""Built-in router plugins, one per module.

Each module exposes ``TYPE_NAME`` (the kebab-case name used in configs), ``KIND``, a strict
``Params`` model and the plugin class, whose constructor takes the validated ``Params``.
``registry.default_registry`` lists them; nothing registers itself on import.
"""
