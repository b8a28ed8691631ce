"""TensorFlow: the process that converts a SavedModel to ONNX for an ONNX job
(`python -m aoed.backends.tensorflow.convert`, started by aoed.engine.tfconvert)."""
