"""The applications built on the flexmoe library: the ``flexmoe`` command and what its subcommands run.

Training (the MoE GPT on tiny Shakespeare), the benchmark, plots, checkpoints' resharding and sampling, and the
cost model's calibrate / validate / simulate. They need the ``train`` extra (tqdm, matplotlib); the library
(``import flexmoe``) does not.
"""
