"""What ``offload demo`` trains: a tiny GPT-style decoder on generated text.

Nothing is downloaded: the model is defined here (``model``), the text comes from a seeded
grammar (``corpus``) and tokens are bytes. ``train`` holds the loop shared by the demo, the
end-to-end benchmark and the tests.
"""
from offload.demo.corpus import Batches, decode, encode, generate_text
from offload.demo.model import GPTConfig, TinyGPT, config_for_params
from offload.demo.train import DemoConfig, RunResult, StepRecord, compare_losses, run

__all__ = [
    "GPTConfig", "TinyGPT", "config_for_params",
    "Batches", "generate_text", "encode", "decode",
    "DemoConfig", "RunResult", "StepRecord", "run", "compare_losses",
]
