"""``engine: mocker``: Dynamo's mocker, a simulated engine with a real scheduler (its
sections, host, adapter and child processes)."""
