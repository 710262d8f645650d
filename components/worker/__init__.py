"""Worker component: serves generate on an engine (torch CPU reference, mocker, GPU engines)."""
