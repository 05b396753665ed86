"""Helpers for tests and examples: tiny random models and pipelines, written locally (no
hub access). Imported on use only; nothing here is loaded by ``import hsdp``."""
