"""vLLM plugin (entry point ``vllm.general_plugins``: ``omni_stream = omni_stream.engine.vllm.plugin:register``).

vLLM calls ``register`` in every process it starts; it makes the talker decoder
(``model.OmniStreamTalker``) known to vLLM's model registry under its architecture name.
"""

from __future__ import annotations

ARCHITECTURE = "OmniStreamTalker"


def register() -> None:
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "omni_stream.engine.vllm.model:OmniStreamTalker")
