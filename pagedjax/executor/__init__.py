"""Device side of the engine: loading a model onto its devices, the compiled step and the
runner that feeds it (`model_loading`, `step`, `model_runner`), and the host-side packing of
a step's inputs (`input_batch`, numpy only, so that `engine` can import its constants).

This package's `__init__` imports nothing, so importing `executor.input_batch` pulls in no jax.
"""
