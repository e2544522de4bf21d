"""HTTP / WebSocket serving layer: OpenAI-compatible speech API over an abstract Backend."""
