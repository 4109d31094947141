"""Stage 3, training: the recipe each rank runs (recipe.py, read top to bottom), its data,
loss, metrics, checkpoints and adapter output.

``python -m shardtune.train CONFIG.yaml`` runs one worker of a fine-tune (what the launcher starts).
"""
