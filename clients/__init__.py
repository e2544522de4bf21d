"""omni-stream clients: a streaming Python client and its playback model."""
