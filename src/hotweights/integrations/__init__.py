"""Trainer integrations: each submodule imports its framework only when used (``import hotweights`` stays light).

- :mod:`hotweights.integrations.trl`: TRL trainers that generate through vLLM (GRPO, RLOO, distillation).
"""
