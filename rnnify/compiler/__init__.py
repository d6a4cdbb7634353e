"""The compile path, in the order it runs: ``capture`` loads the source (a Hugging Face directory,
a cached hub id, a loaded model, or a GGUF file through ``gguf``) and exports it with torch.export;
``plan`` gives each layer (or head) its target; ``passes`` rewrite the graph into a recurrent step;
``convert`` runs them all and returns a ``rnnify.runtime.RecurrentModel`` (``rnnify.convert``).

Nothing is imported here, so ``import rnnify.compiler.plan`` does not pay for torch.export.
"""
