"""Stage 4, after the training workers: commands that use a trained adapter
or a finished run (merge, eval, generate, report), and GGUF import."""
