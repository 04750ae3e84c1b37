"""The loop around the model: the optimizer's steps and ``zero_grad``, the GradScaler, LR schedulers, clipping calls, checkpoints and copies."""
