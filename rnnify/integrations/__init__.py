"""Converted models inside other tools: transformers' ``generate`` and ``pipeline``
(``rnnify.integrations.transformers``), which is also how stock lm-evaluation-harness runs them
(``lm_eval --model hf``, docs/interop.md).

What a saved directory says to those tools (its ``config.json`` and ``modeling_rnnify.py``) is
written by ``rnnify.runtime.hf_files``, part of the saved format; it imports nothing heavy, so
saving a model does not load transformers' model classes.
"""
