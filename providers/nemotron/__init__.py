"""Nemotron MoE VLM providers (RADIO vision encoder + hybrid Mamba/MoE/attention LLM).

Work in progress: the local backend's plain-PyTorch Mamba-2 mixer (`mamba_mixer.py`) is here; the provider is
not registered yet.
"""
