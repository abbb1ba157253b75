"""The torch dtype of each precision name that job files and the CLI use (fp32, bf16, fp16):
one table for the runtime, the doctor, the models and the exports."""

from __future__ import annotations

import torch

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
