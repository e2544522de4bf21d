"""vLLM as the talker's engine (``--engine vllm``).

- ``plugin``: the ``vllm.general_plugins`` entry point that registers the talker decoder.
- ``model``: the decoder as a vLLM model class (slot ids, the per-step input feed).
- ``runner``: ``VllmTalker``, an in-process vLLM engine under ``FrameEngine`` with a
  step-planning scheduler.
- ``env``: the separate environment vLLM runs in (standard library only).

Only ``env`` may be imported without vLLM installed.
"""
