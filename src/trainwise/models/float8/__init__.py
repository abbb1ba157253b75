"""Float8 training (precision.float8): torchao's Float8Linear as a model converter.

- `rule`: which Linears are converted (dimensions multiples of 16, not the output head:
  torchtitan's filter); plain data, no torch: the planner prices the same ones;
- `convert`: torchao's config for the recipe, the layout and the device (emulated on
  CPU), the converter (models.converters) with its post-optimizer hook (the weights'
  float8 scales for FSDP's all-gather), and what keeps a job from float8;
- `parallel`: the tensor-parallel styles of the converted Linears (torchao's float8
  styles under the tensorwise recipe) and float8's all-gathers on gloo.

torchao is imported on first use: a job without float8 (and the planner, which imports only
`rule`) never loads it.
"""
