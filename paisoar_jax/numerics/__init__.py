"""How numbers are computed: precision policies, loss scaling, fp8, rematerialisation.

Owns: the bf16/fp16/fp8 policies and what they do to a model of one's own (precision), the
dynamic and static loss scaler (loss_scale), fp8 scaled matmuls (fp8), and remat policies
(remat). May import: config, errors, output, runtime, parallel.
"""
