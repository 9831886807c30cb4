"""The model zoo: the project's own small models, built from data present on every machine.

Nothing here downloads a model. ``tierline zoo build`` trains (or, for the ``demo`` preset, takes the
committed weights), derives edge artifacts (ONNX fp32 with KV cache, ONNX INT8, TFLite), writes a signed
manifest for each artifact, and verifies them.
"""
