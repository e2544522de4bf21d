"""Other CPU implementations of Qwen3-TTS, measured beside omni-stream by ``peer_bench.py``.

Each peer lives in its own virtualenv under the cache (``setup.py``), reads the same random
checkpoint through its own converter (``vox_build.py``, ``gguf_convert.py``) and is timed by
``worker.py``, which runs inside the peer's environment and imports nothing of omni-stream.
"""
