"""Models built on :class:`flexmoe.MoELayer`: a GPT-style language model and its dense twin."""

from flexmoe.apps.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
