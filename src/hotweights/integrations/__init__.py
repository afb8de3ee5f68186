"""Trainer integrations: each submodule imports its framework only when used (``import hotweights`` stays light).

- :mod:`hotweights.integrations.trl`: TRL trainers that generate through vLLM (GRPO, RLOO, distillation).
- :mod:`hotweights.integrations.verl`: verl's colocated vLLM rollout (``VerlWorkerExtension``: verl's own sender).
- :mod:`hotweights.integrations.ray`: engines in Ray actors.
"""
