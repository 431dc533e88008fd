"""The run's parameters: TrainParams and EvalParams, their
validation, flag declarations and --help groups, recorded
params, refusals before TensorFlow's import.

(docs/layout.md: the map.)
"""
