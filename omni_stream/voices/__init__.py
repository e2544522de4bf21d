"""Cloned voices (Base variant) around the models: reference audio in, a stored voice out.

- ``audio.py``: uploaded bytes -> mono audio, with the 4xx a bad clip deserves.
- ``encode.py``: audio -> ``models.voice_clone.VoiceClone`` (speaker and tokenizer encoders).
- ``store.py``: uploaded voices on disk, per model, surviving restarts.
- ``cli.py``: ``omni-stream voices add|list|delete`` against a running server.
"""
