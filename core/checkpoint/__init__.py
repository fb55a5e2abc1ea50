"""Checkpoints: mimo's own (layout, save and load, checks), foreign formats, and Hugging Face conversion."""
