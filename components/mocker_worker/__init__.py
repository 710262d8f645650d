"""Worker component backed by Dynamo's mocker: a simulated engine with a real scheduler."""
