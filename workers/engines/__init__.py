"""Engines: one module each; only ``vllm.py`` imports vllm."""
