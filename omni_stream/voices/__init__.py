"""Cloned voices (Base variant): reference audio in, a prompt's speaker slot and reference codes out.

- ``clone.VoiceClone``: what a cloned voice puts into a prompt (x-vector, reference codes and
  transcript), shared by the encoder that makes it, the store that keeps it and the prompt
  builder that uses it.
"""
