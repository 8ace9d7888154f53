"""Layer 4, the numerics of training: the loss, the optimizer with its loss scaler and schedule, one optimizer step,
held-out evaluation, the fp16 overflow watch."""
