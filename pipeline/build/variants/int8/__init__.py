"""The int8 variants (`onnx-int8-dynamic`, `onnx-int8-static`, `int8`): shared.py holds what they
share, onnx_int8.py and torch_int8.py their converters, the rest the quantization steps they use."""
