"""Converted models inside other tools: transformers' ``generate`` and ``pipeline``
(``rnnify.integrations.transformers``) and lm-evaluation-harness (``rnnify.integrations.lm_eval``).

``hf_files`` writes what a converted directory says to those tools (its ``config.json`` and
``modeling_rnnify.py``); it imports nothing heavy, so saving a model does not load transformers'
model classes.
"""
