"""sage-grpo: GRPO post-training of HunyuanVideo-1.5 with the SAGE-GRPO sampler and trust region."""

import logging as _logging

# torchao (the `lora` extra, for --fp8_base) is imported by diffusers and peft whenever it is installed, before any
# CLI can quiet the libraries: on a CPU-only torch its CUDA kernel libraries fail to load with a warning each (the
# FP8 weight-only path does not use them), its enums trip a deprecation warning of torch's pytree, and diffusers 0.42
# warns that it cannot import torchao 0.18's tensor types (for loading torchao-serialized checkpoints, which nothing
# here loads). Each would turn a user error's one line into several, so these loggers show errors only, from the
# package's first import on.
for _name in ("torchao", "torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)
